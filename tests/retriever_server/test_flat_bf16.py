"""The bf16-screened exact Flat search: same top-k as an fp64 brute force, and a certificate that
flags the near-ties the bf16 screen cannot decide (those queries go to faiss's fp32 search)."""
import numpy as np
import pytest

from retriever_server.flat_bf16 import GROUP, Bf16FlatScreen


def _unit(rng, n, d=64):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _reference(q, x, k):
    """fp64 brute force: (scores [B, k] descending, ids [B, k])."""
    s = q.astype(np.float64) @ x.astype(np.float64).T
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, ids, axis=1), ids


@pytest.fixture(autouse=True)
def _one_thread():
    import torch
    torch.set_num_threads(1)


@pytest.mark.parametrize("n,k,margin", [(1000, 3, 32), (1003, 10, 8), (37, 5, 32), (37, 37, 4),
                                        (20, 50, 32), (5000, 1, 1)])
def test_certified_rows_equal_brute_force(n, k, margin):
    rng = np.random.default_rng(n + k)
    x = _unit(rng, n)
    # queries near stored rows (what retrieval looks like) and random ones
    q = np.concatenate([x[rng.integers(0, n, 40)] + 0.3 * _unit(rng, 40), _unit(rng, 40)]).astype(np.float32)
    scores, ids, certified = Bf16FlatScreen(x, margin=margin).search(q, k)
    ref_s, ref_i = _reference(q, x, min(k, n))
    assert scores.shape == ids.shape == (80, min(k, n))
    assert certified.mean() > 0.5  # random unit vectors have well-separated top scores
    np.testing.assert_allclose(scores[certified], ref_s[certified], atol=1e-5)
    assert (ids[certified] == ref_i[certified]).all()
    assert (np.diff(scores, axis=1) <= 0).all() and (ids < n).all() and (ids >= 0).all()


def test_near_tie_across_groups_is_not_certified():
    """Two rows whose scores differ far below bf16 resolution, in different screening groups: the
    screen cannot order them, so whatever it returns must come without a certificate."""
    rng = np.random.default_rng(1)
    d = 64
    q = _unit(rng, 1, d)
    x = _unit(rng, 4 * GROUP, d) * 0.1                  # background rows with low scores
    x[0] = q[0] * (1 - 2e-4)                             # near-tie, in group 0 (row mod n_groups)
    x[GROUP + 3] = q[0]                                  # the true best, in group 3
    x = x.astype(np.float32)
    scores, ids, certified = Bf16FlatScreen(x, margin=1).search(q, 1)
    assert not certified[0]
    # with room for the near-tie in the candidate pool, the exact rescoring decides it and certifies
    scores, ids, certified = Bf16FlatScreen(x, margin=4).search(q, 1)
    assert certified[0] and ids[0, 0] == GROUP + 3


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="float32"):
        Bf16FlatScreen(np.zeros((4, 3), np.float64))
    with pytest.raises(ValueError, match="margin"):
        Bf16FlatScreen(np.zeros((4, 3), np.float32), margin=0)


def test_dense_searcher_bf16_equals_faiss(tmp_path):
    """DenseSearcher with the screen (forced on) returns faiss's own Flat results, including the
    fallback for a query whose top-k are near-ties the screen cannot certify."""
    import faiss
    from retriever_server.dense_index import FAISS_FILE, DenseSearcher
    from retriever_server.encoder import TextEncoder
    from retriever_server.dense_index import default_model_path

    texts = ["Where was the founder of the company born?", "In what year was the river bridge built?",
             "Which inventor designed the steam loom?", "Who founded the first university in the city?"]
    enc = TextEncoder(default_model_path())
    q = enc.encode(texts)
    rng = np.random.default_rng(0)
    x = _unit(rng, 300, q.shape[1]) * 0.5
    # More near-copies of query 0 than the screen's candidate pool holds, 1e-5 apart (far below bf16
    # resolution, far above fp32's): the screen cannot certify, faiss must decide.
    for i in range(40):
        x[5 + 7 * i] = q[0] * (1 - 1e-5 * (i + 1))
    x[295] = q[0]
    x[100] = q[1]
    x = x.astype(np.float32)
    index = faiss.IndexFlatIP(q.shape[1])
    index.add(x)
    faiss.write_index(index, str(tmp_path / FAISS_FILE))
    params = {"dim": q.shape[1], "faiss": "flat"}
    ref = DenseSearcher(tmp_path, params, flat_search="faiss")
    bf16 = DenseSearcher(tmp_path, params, flat_search="bf16")
    assert ref.screen is None and bf16.screen is not None
    assert bf16.describe()["flat_search"] == "bf16"
    _, _, certified = bf16.screen.search(q, 1)
    assert not certified[0]  # the near-tie goes through the fallback
    for k in (1, 3, 10):
        for (r_rows, r_scores), (b_rows, b_scores) in zip(ref.search(texts, k), bf16.search(texts, k)):
            np.testing.assert_array_equal(b_rows, r_rows)
            np.testing.assert_allclose(b_scores, r_scores, atol=1e-5)
    assert bf16.search(texts, 1)[0][0][0] == 295
    assert list(bf16.search(texts, 3)[0][0]) == [295, 5, 12]


def test_bf16_refused_for_non_flat_index(tmp_path):
    import faiss
    from retriever_server.dense_index import FAISS_FILE, DenseSearcher
    index = faiss.IndexHNSWFlat(384, 8, faiss.METRIC_INNER_PRODUCT)
    index.add(_unit(np.random.default_rng(0), 50, 384))
    faiss.write_index(index, str(tmp_path / FAISS_FILE))
    with pytest.raises(ValueError, match="flat_search=bf16 needs a Flat"):
        DenseSearcher(tmp_path, {"dim": 384, "faiss": "hnsw"}, flat_search="bf16")
    assert DenseSearcher(tmp_path, {"dim": 384, "faiss": "hnsw"}).flat_search == "faiss"
