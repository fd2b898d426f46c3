"""Fast, exact tokenization of ASCII text for byte-level BPE tokenizers (GPT-2 style, e.g. SmolLM2).

Why: for a batch of 512 search observations the Rust tokenizer spends nearly all of its time in the
byte-level pre-tokenizer's regex (about 0.13 s per round of 512 x 128-token observations on this
machine), not in BPE. For ASCII text the GPT-2 split pattern is equivalent to a plain `re` pattern,
which Python runs several times faster; each piece's ids then come from a dict, and only unseen
pieces go to the tokenizer's own BPE model (`model.tokenize`, the very step the Rust pipeline runs
per piece). The result is the pipeline's result, id for id:

    encode(text) = concat(model.tokenize(byte_map(piece)) for piece in split(text))

`PieceEncoder.for_tokenizer(tok)` returns None unless the tokenizer is exactly that pipeline (no
normalization, ByteLevel pre-tokenizer with the regex and no prefix space, deterministic BPE, no
truncation or padding) and a self-check on tricky probe text agrees with the tokenizer; callers then
use the tokenizer itself. Text that is not ASCII or that contains an added token goes the normal way.
"""
from __future__ import annotations

import re

# GPT-2's pre-tokenizer pattern restricted to ASCII: \p{L} = [A-Za-z], \p{N} = [0-9], \s = the six
# ASCII whitespace characters (re.ASCII), exactly what the Unicode classes match on ASCII input.
_SPLIT_RE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""",
                       re.ASCII)

# Characters and whitespace runs that exercise every branch of the pattern (checked at start-up).
_PROBE = ("Doc 1(Title: \"O'Neil's\" Bar) it's   they're  we've I'm you'll he'd 3.14 x2 -- \t\n"
          "  trailing spaces  \n\n\nnew\r\nline\x0bvt\x0cff \x1f\x1c ctrl\x00 #$%^&*()_+=[]{}|;:',.<>/?`~ "
          "UPPER lower MiXeD 12345678901234567890 a'b 's 't '  ' x  ")


def _byte_map() -> list[str]:
    """The byte-level alphabet: byte b -> the printable character that stands for it in the vocab."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_ASCII_TABLE = {b: c for b, c in enumerate(_byte_map()[:128])}


class PieceEncoder:
    """Token ids of ASCII texts through a piece -> ids cache (see the module docstring)."""

    def __init__(self, backend, cache_pieces: int = 200_000):
        self.model = backend.model
        self.cache_pieces = cache_pieces
        self._ids: dict[str, list[int]] = {}
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        self._added_re = re.compile("|".join(map(re.escape, added))) if added else None

    @classmethod
    def for_tokenizer(cls, tokenizer) -> PieceEncoder | None:
        """A PieceEncoder if `tokenizer` (HF fast tokenizer or `tokenizers.Tokenizer`) qualifies."""
        backend = getattr(tokenizer, "_tokenizer", tokenizer)
        try:
            from tokenizers import models, pre_tokenizers
            pre, model = backend.pre_tokenizer, backend.model
            if not (isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex and not pre.add_prefix_space):
                return None
            if not isinstance(model, models.BPE) or model.dropout not in (None, 0.0):
                return None
            if backend.truncation is not None or backend.padding is not None:
                return None
            ascii_text = "".join(map(chr, range(128)))
            if backend.normalizer is not None and backend.normalizer.normalize_str(ascii_text) != ascii_text:
                return None
            if any(t.lstrip or t.rstrip or t.single_word or t.normalized
                   for t in backend.get_added_tokens_decoder().values()):
                return None
            enc = cls(backend)
            probes = [_PROBE, _PROBE[7:], _PROBE.strip(), " " + _PROBE, "\n", "  ", "a"]
            expected = [e.ids for e in backend.encode_batch(probes, add_special_tokens=False)]
            if enc.encode(probes) != expected:
                return None
            enc._ids.clear()
            return enc
        except (AttributeError, TypeError, ValueError, ImportError):
            return None  # an unexpected tokenizer layout: use the tokenizer itself

    def fits(self, text: str) -> bool:
        """Whether `text` may take the fast path (ASCII, no added-token string inside)."""
        return text.isascii() and (self._added_re is None or self._added_re.search(text) is None)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text (each must satisfy `fits`), no special tokens added."""
        pieces_of = [_SPLIT_RE.findall(t) for t in texts]
        ids = self._ids
        new = {p for pieces in pieces_of for p in pieces if p not in ids}
        if len(ids) + len(new) > self.cache_pieces:
            ids.clear()  # wholesale eviction, as in the line cache
            new = {p for pieces in pieces_of for p in pieces}
        tokenize = self.model.tokenize
        for p in new:
            ids[p] = [t.id for t in tokenize(p.translate(_ASCII_TABLE))]
        out = []
        for pieces in pieces_of:
            row: list[int] = []
            for p in pieces:
                row += ids[p]
            out.append(row)
        return out
