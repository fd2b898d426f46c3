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

import itertools
import os
import re

# The one switch: SEARCH_R1_BPE_CACHE=0 makes both `for_tokenizer`s return None, so every caller
# uses the tokenizer itself (for benchmarks and for ruling this module out when debugging).
SWITCH_ENV = "SEARCH_R1_BPE_CACHE"


def enabled() -> bool:
    """False when SEARCH_R1_BPE_CACHE is set to 0 / false / off."""
    return os.environ.get(SWITCH_ENV, "1").strip().lower() not in ("0", "false", "off", "no")

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
        if not enabled():
            return None
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
        new = set(itertools.chain.from_iterable(pieces_of)).difference(ids)
        if len(ids) + len(new) > self.cache_pieces:
            ids.clear()  # wholesale eviction, as in the line cache
            new = set(itertools.chain.from_iterable(pieces_of))
        tokenize = self.model.tokenize
        for p in new:
            ids[p] = [t.id for t in tokenize(p.translate(_ASCII_TABLE))]
        chain, get = itertools.chain.from_iterable, ids.__getitem__
        out = [list(chain(map(get, pieces))) for pieces in pieces_of]
        return out


_CHAR_BYTES = {c: b for b, c in enumerate(_byte_map())}
# byte-level character -> the latin-1 character of its byte; every other character -> U+FFFF, which
# makes `.encode("latin-1")` fail, so tokens outside the alphabet are never mis-decoded.
_TO_LATIN1 = {c: _CHAR_BYTES.get(chr(c), 0xFFFF) for c in range(0x144)}
_BYTE_FALLBACK_RE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


_DECODERS: dict[int, tuple[object, ByteDecoder | None]] = {}


class ByteDecoder:
    """Exact, fast decode (special tokens kept) for byte-level BPE tokenizers.

    Each id's bytes come from a table built once; a row's text is `b"".join(bytes).decode("utf-8")`,
    which is what the ByteLevel decoder computes whenever the bytes are valid UTF-8. Rows with invalid
    UTF-8 or ids the table does not cover go through the tokenizer's own `decode_batch`.
    `for_tokenizer` returns None unless every covered id, and a sample of id sequences, decode
    exactly as the tokenizer decodes them.
    """

    def __init__(self, backend, table: list[bytes | None]):
        self.backend = backend
        self.table = table

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ByteDecoder | None:
        """The decoder for `tokenizer`, built once per tokenizer object (building takes ~0.1 s)."""
        if not enabled():
            return None
        backend = getattr(tokenizer, "_tokenizer", tokenizer)
        hit = _DECODERS.get(id(backend))
        if hit is not None and hit[0] is backend:
            return hit[1]
        dec = cls._build(backend)
        if len(_DECODERS) >= 8:
            _DECODERS.clear()
        _DECODERS[id(backend)] = (backend, dec)  # holding `backend` keeps its id from being reused
        return dec

    @classmethod
    def _build(cls, backend, check_rows: int = 64, seed: int = 0) -> ByteDecoder | None:
        try:
            from tokenizers import pre_tokenizers
            if not isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel) or backend.decoder is None:
                return None
            vocab = backend.get_vocab(with_added_tokens=True)  # token -> id
            added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
            table: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
            for token, i in vocab.items():
                if i in added or "\u2581" in token or _BYTE_FALLBACK_RE.fullmatch(token):
                    continue
                try:
                    table[i] = token.translate(_TO_LATIN1).encode("latin-1")
                except UnicodeEncodeError:
                    pass  # a character outside the byte-level alphabet: leave it to the tokenizer
            for i, token in added.items():  # added tokens decode to their content; keep plain ones
                if i < len(table) and token.isascii() and token.isprintable() and " " not in token:
                    table[i] = token.encode()
            covered = [i for i, b in enumerate(table) if b is not None]
            if not covered:
                return None
            dec = cls(backend, table)
            # Every covered id (in rows of 256 ids that each decode alone) and random sequences of
            # them: catches decoders that treat position or neighbours specially (a stripped space).
            import random
            rng = random.Random(seed)
            alone = [i for i in covered if _is_utf8(table[i])]
            rows = [alone[k:k + 256] for k in range(0, len(alone), 256)]
            rows += [[rng.choice(covered) for _ in range(rng.randint(1, 40))] for _ in range(check_rows)]
            theirs = backend.decode_batch(rows, skip_special_tokens=False)
            for row, text in zip(rows, theirs):
                data = b"".join(table[i] for i in row)
                if _is_utf8(data) and data.decode("utf-8") != text:
                    return None
            return dec
        except (AttributeError, TypeError, ValueError, ImportError):
            return None

    def decode(self, id_lists: list[list[int]]) -> list[str]:
        table, out, slow = self.table, [], []
        for k, ids in enumerate(id_lists):
            try:
                out.append(b"".join(map(table.__getitem__, ids)).decode("utf-8"))
            except (TypeError, IndexError, UnicodeDecodeError):  # None entry, unknown id, bad UTF-8
                out.append(None)
                slow.append(k)
        if slow:
            texts = self.backend.decode_batch([list(id_lists[k]) for k in slow], skip_special_tokens=False)
            for k, text in zip(slow, texts):
                out[k] = text
        return out


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
