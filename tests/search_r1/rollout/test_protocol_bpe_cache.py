"""The fast ASCII path of observation tokenization must give the tokenizer's own ids, id for id."""
import random

import pytest

from search_r1.bpe_cache import PieceEncoder
from search_r1.protocol import ObservationEncoder, encode_texts
from tests.search_r1.rollout.scripted import smollm2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_piece_encoder_matches_tokenizer_on_random_ascii(tok):
    enc = PieceEncoder.for_tokenizer(tok)
    assert enc is not None, "SmolLM2's byte-level BPE tokenizer should qualify for the fast path"
    rng = random.Random(0)
    # Letters, digits, contractions, every ASCII whitespace kind and punctuation, in runs.
    alphabet = "abZ'stmrevld0129 \t\n\r\x0b\x0c.,!-_\"<>|\x00\x1f("
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(5000)]
    texts += ["Doc 1(Title: \"Ann's Bar\") it's  they'll 3.14\n", "   ", "\n\n", "x  \n  y", "'re're 's'"]
    assert enc.encode(texts) == encode_texts(tok, texts)
    assert enc.encode(texts) == encode_texts(tok, texts)  # second pass: all pieces from the cache


def test_piece_encoder_refuses_non_ascii_and_added_tokens(tok):
    enc = PieceEncoder.for_tokenizer(tok)
    assert enc.fits("plain text\n")
    assert not enc.fits("café")
    assert not enc.fits("a <|im_end|> b")


def test_piece_encoder_declines_other_tokenizers():
    from tokenizers import Tokenizer, models, pre_tokenizers
    wordlevel = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()
    assert PieceEncoder.for_tokenizer(wordlevel) is None


def test_encoder_with_and_without_fast_path_agree(tok):
    fast = ObservationEncoder(tok, "tags")
    slow = ObservationEncoder(tok, "tags")
    slow._pieces = None
    passages = ["Doc 1(Title: \"Paris\") Paris is the capital of France.\nDoc 2(Title: Café) Crème brûlée <|im_end|>\n",
                "Doc 1(Title: X) it's  spaced   out\t\ttabs\n\n"]
    kinds, budgets = ["search", "search", "invalid"], [500, 12, 500]
    assert fast.encode(kinds, passages + [None], budgets) == slow.encode(kinds, passages + [None], budgets)


def test_byte_decoder_matches_tokenizer(tok):
    from search_r1.bpe_cache import ByteDecoder
    from search_r1.protocol import decode_ids
    dec = ByteDecoder.for_tokenizer(tok)
    assert dec is not None and ByteDecoder.for_tokenizer(tok) is dec  # built once per tokenizer
    rng = random.Random(1)
    size = len(dec.table)
    # Random ids (often invalid UTF-8 across tokens: those rows take the tokenizer's path), special
    # tokens, real text, an empty row and an out-of-range id.
    rows = [[rng.randrange(size) for _ in range(rng.randint(0, 30))] for _ in range(3000)]
    rows += [encode_texts(tok, ["<think>café ☕ naïve</think>\n<search> x </search>"])[0], [],
             [tok.eos_token_id, 1, 2], encode_texts(tok, ["<|im_end|> plain"])[0]]
    assert dec.decode(rows) == decode_ids(tok, rows)
    # An id past the table falls through to the tokenizer, whatever it does with it.
    assert dec.decode([[size + 10, 1]]) == decode_ids(tok, [[size + 10, 1]])


def test_one_switch_turns_the_cache_off_and_the_ids_stay_the_same(monkeypatch):
    from search_r1.bpe_cache import ByteDecoder
    from search_r1.protocol import ObservationEncoder

    tok = smollm2_tokenizer()
    passages = ["Doc 1(Title: \"Paris\") Paris is the capital of France. It's big."]
    on = ObservationEncoder(tok, "tags").encode(["search"], [passages[0]], [64])
    assert PieceEncoder.for_tokenizer(tok) is not None and ByteDecoder.for_tokenizer(tok) is not None
    monkeypatch.setenv("SEARCH_R1_BPE_CACHE", "0")
    assert PieceEncoder.for_tokenizer(tok) is None and ByteDecoder.for_tokenizer(tok) is None
    assert ObservationEncoder(tok, "tags").encode(["search"], [passages[0]], [64]) == on
