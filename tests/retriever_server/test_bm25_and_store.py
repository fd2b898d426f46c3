"""BM25 search against bm25s's own scorer (independent reference), the pruned search against the
exhaustive one, and the memory-mapped document store."""
import json
import random

import bm25s
import numpy as np
import pytest

from retriever_server.bm25_index import BM25Searcher, QueryTokenizer, top_k_rows
from retriever_server.corpus_store import CorpusWriter, DocStore, build_store, iter_corpus
from retriever_server.manifest import read_manifest


@pytest.fixture(scope="module")
def searcher(retriever_server):
    d = retriever_server.index_dir
    return BM25Searcher(d, read_manifest(d).params)


def _queries(retriever_server, n=60):
    rng = random.Random(0)
    docs = [json.loads(line)["contents"] for line in open(retriever_server.corpus_path)]
    words = " ".join(docs).split()
    qs = [" ".join(rng.sample(words, rng.randint(1, 8))) for _ in range(n)]
    return qs + ["the of and", "zzzz unknownword", docs[0].split("\n")[0], "born born city"]


def test_scores_equal_bm25s_get_scores(retriever_server, searcher):
    """Our batched top-k = the top of bm25s's own dense score vector, query by query."""
    ref = bm25s.BM25.load(retriever_server.index_dir / "bm25")
    for q, (rows, scores) in zip(_queries(retriever_server), searcher.search(_queries(retriever_server), 5)):
        ids = searcher.tokenizer.ids(q)
        full = ref.get_scores(ids) if ids else np.zeros(searcher.n_docs, np.float32)
        expected = np.sort(full[full > 0])[::-1][:5]
        np.testing.assert_allclose(scores, expected, rtol=1e-5, err_msg=q)
        np.testing.assert_allclose(full[rows], scores, rtol=1e-5, err_msg=q)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_pruned_equals_exhaustive(retriever_server, searcher, k):
    qs = _queries(retriever_server, 150)
    qs += [f"{a} {a} {b}" for a, b in zip(qs[:40], qs[40:80])]  # repeated tokens count twice
    tokens = [searcher.tokenizer.ids(q) for q in qs]
    exhaustive = searcher.search_exhaustive(tokens, k)
    for q, ids, (rows, scores) in zip(qs, tokens, exhaustive):
        pruned = searcher.search_pruned(ids, k)
        assert pruned is not None
        np.testing.assert_allclose(pruned[1], scores, rtol=1e-5, err_msg=q)


def test_query_tokenizer_matches_bm25s_and_does_not_grow(retriever_server):
    save_dir = retriever_server.index_dir / "bm25"
    ours = QueryTokenizer(save_dir, "english")
    import Stemmer
    theirs = bm25s.tokenization.Tokenizer(stopwords=None, stemmer=Stemmer.Stemmer("english"))
    theirs.load_vocab(save_dir)
    theirs.load_stopwords(save_dir)
    size = len(ours._vocab)
    for q in _queries(retriever_server, 20):
        expected = theirs.tokenize([q], update_vocab=False, show_progress=False, allow_empty=False)[0]
        assert ours.ids(q) == expected, q
    ours.ids("completely novel wordings xyzzy plugh")
    assert len(ours._vocab) == size


def test_top_k_rows_orders_by_score_then_row():
    import scipy.sparse as sp
    # row 0: cols 0..4 with scores 1, 5, 3, 5, 2 -> top 3 = col 1 (5), col 3 (5, tie -> lower col first), col 2 (3)
    m = sp.csr_matrix(np.array([[1, 5, 3, 5, 2], [0, 0, 0, 0, 0]], dtype=np.float32))
    (rows0, s0), (rows1, s1) = top_k_rows(m, 3)
    assert rows0.tolist() == [1, 3, 2] and s0.tolist() == [5, 5, 3]
    assert rows1.tolist() == [] and s1.tolist() == []


def test_store_roundtrip_lookup_and_formats(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join([
        json.dumps({"id": "a", "contents": '"T"\ntext \u00e9'}),
        json.dumps({"id": 7, "title": "Other", "text": "body"}),   # title/text form, int id
        "",
        json.dumps({"contents": '"X"\nno id'}),                       # no id: row number
    ]) + "\n")
    list(build_store(corpus, tmp_path / "docs"))
    store = DocStore(tmp_path / "docs")
    assert len(store) == 3
    assert store.document(0) == {"id": "a", "contents": '"T"\ntext \u00e9'}
    assert store.document(1) == {"id": "7", "contents": '"Other"\nbody'}
    assert store.doc_id(2) == "2"
    assert [store.row_of(i) for i in ("a", "7", "2", "missing")] == [0, 1, 2, None]


def test_store_rejects_duplicates_empty_and_bad_lines(tmp_path):
    w = CorpusWriter(tmp_path / "dup")
    w.add("x", "one")
    w.add("x", "two")
    with pytest.raises(ValueError, match="duplicate document ids"):
        w.close()
    with pytest.raises(ValueError, match="no documents"):
        CorpusWriter(tmp_path / "empty").close()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(iter_corpus(bad))
    bad.write_text('{"id": "1", "contents": 5}\n')
    with pytest.raises(ValueError, match="'contents' must be a string"):
        list(iter_corpus(bad))


def test_store_is_memory_mapped(retriever_server):
    store = DocStore(retriever_server.index_dir / "docs")
    assert isinstance(store._c_off, np.memmap) and isinstance(store._hash, np.memmap)
    import mmap
    assert isinstance(store._contents, mmap.mmap)


def test_index_without_query_vocab_is_refused_with_the_rebuild_command(retriever_server, tmp_path):
    import shutil
    from retriever_server.bm25_index import QUERY_VOCAB
    old = tmp_path / "bm25"
    shutil.copytree(retriever_server.index_dir / "bm25", old)
    (old / QUERY_VOCAB).unlink()
    with pytest.raises(ValueError, match=r"no query_vocab.json.*python -m retriever_server build"):
        QueryTokenizer(old, "english")
