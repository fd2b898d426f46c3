"""Dense (MiniLM + faiss) build and serve, int8 query encoder, and hybrid RRF fusion.

A 120-passage slice of the synthetic corpus keeps encoding cheap; the model loads once per server.
"""
import json
import os

import numpy as np
import pytest
import requests

from retriever_server.bm25_index import BM25Searcher
from retriever_server.cpu import has_native_bf16
from retriever_server.fusion import rrf_fuse
from retriever_server.manifest import read_manifest
from tests._fixtures.retriever import RetrieverHandle, build_retriever_index

N_PASSAGES = 120


@pytest.fixture(scope="module")
def dense_world(synth_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    lines = open(synth_world / "corpus.jsonl").read().splitlines()[:N_PASSAGES]
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    docs = [json.loads(line) for line in lines]
    bm25 = build_retriever_index(corpus, "bm25", root / "bm25")
    # in-process (same code as the CLI's build): this process imports transformers for the int8
    # test anyway, and a subprocess would pay that import again
    import torch
    from retriever_server.indexes import build_index
    torch.set_num_threads(1)
    dense = build_index(corpus, "dense", root / "dense")
    servers = {}
    for name, dirs, flags in [("dense", [dense], {}), ("hybrid", [bm25, dense], {"rrf_depth": 10})]:
        servers[name + "_server"] = RetrieverHandle(dirs, log_path=root / f"{name}.log", flags=flags).launch()
    for server in servers.values():  # both load the model at the same time
        server.wait_healthy()
    yield {"root": root, "docs": docs, "bm25": bm25, "dense": dense, **servers}
    for s in servers.values():
        s.stop()


def _queries(docs, n=20):
    # the body text of a passage, minus its title: dense retrieval should find that passage
    return [d["contents"].split("\n", 1)[1][:120] for d in docs[:n]], [d["id"] for d in docs[:n]]


def test_dense_manifest_and_serving(dense_world):
    m = read_manifest(dense_world["dense"])
    assert m.kind == "dense" and m.corpus_size == N_PASSAGES
    assert m.params["faiss"] == "flat" and m.params["normalized"] and m.params["dim"] == 384
    server = dense_world["dense_server"]
    health = server.health()
    assert health["kind"] == "dense"
    # auto parallelism for a dense index: one search thread per CPU (the fixture pins 1 torch thread)
    assert health["threads"] == {"workers": os.cpu_count() or 1, "torch": 1, "faiss": 1}
    assert health["batching"]["workers"] == health["threads"]["workers"]
    want = "bf16" if has_native_bf16() else "faiss"
    assert health["indexes"][0]["flat_search"] == want and health["indexes"][0]["quantize"] == "none"
    queries, gold = _queries(dense_world["docs"])
    r = requests.post(server.url, json={"queries": queries, "topk": 3, "return_scores": True}, timeout=60)
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    hits = sum(g in [h["document"]["id"] for h in hs] for g, hs in zip(gold, result))
    assert hits / len(gold) >= 0.8
    for hs in result:  # cosine similarities of unit vectors, best first
        scores = [h["score"] for h in hs]
        assert scores == sorted(scores, reverse=True) and all(-1.001 <= s <= 1.001 for s in scores)


def test_rrf_by_hand():
    # A = [1, 2, 3], B = [3, 1, 4], k = 60 (ranks start at 1):
    #   doc1 = 1/61 + 1/62 = 0.032523   doc3 = 1/63 + 1/61 = 0.032266
    #   doc2 = 1/62       = 0.016129   doc4 = 1/63        = 0.015873
    fused = rrf_fuse([[1, 2, 3], [3, 1, 4]], k=60)
    assert [d for d, _ in fused] == [1, 3, 2, 4]
    np.testing.assert_allclose([s for _, s in fused],
                               [1 / 61 + 1 / 62, 1 / 63 + 1 / 61, 1 / 62, 1 / 63])
    # k = 0: doc1 = 1 + 1/2 = 1.5, doc3 = 1/3 + 1 = 1.333, doc2 = 1/2, doc4 = 1/3; topk cuts
    assert rrf_fuse([[1, 2, 3], [3, 1, 4]], k=0, topk=2) == [(1, 1.5), (3, 1 / 3 + 1)]
    # tie (1/61 + 1/62 each): the document met first, scanning rank by rank, wins
    assert [d for d, _ in rrf_fuse([[1, 2], [2, 1]])] == [1, 2]
    assert rrf_fuse([[], []]) == []
    with pytest.raises(ValueError, match="rrf k"):
        rrf_fuse([[1]], k=-1)


def test_served_hybrid_equals_rrf_of_the_two_rankings(dense_world):
    hybrid = dense_world["hybrid_server"]
    h = hybrid.health()
    assert h["kind"] == "hybrid" and h["fusion"] == {"method": "rrf", "k": 60.0, "depth": 10}
    queries = [d["contents"].split("\n")[0].strip('"') + " founded" for d in dense_world["docs"][:15]]
    bm25 = BM25Searcher(dense_world["bm25"], read_manifest(dense_world["bm25"]).params)
    bm25_hits = bm25.search(queries, 10)
    dense_res = requests.post(dense_world["dense_server"].url, json={"queries": queries, "topk": 10}, timeout=60).json()
    served = requests.post(hybrid.url, json={"queries": queries, "topk": 5, "return_scores": True},
                           timeout=60).json()["result"]
    row_of_id = {d["id"]: i for i, d in enumerate(dense_world["docs"])}
    for q, (bm25_rows, _), dense_docs, got in zip(queries, bm25_hits, dense_res["result"], served):
        dense_rows = [row_of_id[d["id"]] for d in dense_docs]
        expected = rrf_fuse([bm25_rows.tolist(), dense_rows], k=60, topk=5)
        assert [row_of_id[g["document"]["id"]] for g in got] == [d for d, _ in expected], q
        np.testing.assert_allclose([g["score"] for g in got], [s for _, s in expected], rtol=1e-5)


def test_hybrid_refuses_indexes_of_different_corpora(dense_world, synth_world, start_retriever, tmp_path):
    other = build_retriever_index(synth_world / "corpus.jsonl", "bm25", tmp_path / "other")
    with pytest.raises(RuntimeError, match="different corpora"):
        start_retriever([other, dense_world["dense"]])


def test_int8_query_encoder_is_close_to_fp32():
    import torch
    from retriever_server.dense_index import default_model_path
    from retriever_server.encoder import TextEncoder
    torch.set_num_threads(1)
    texts = ["Where was the founder of the company born?", "In what year was the university founded?",
             "Which river flows through the capital?", "Who invented the steam engine?"]
    fp32 = TextEncoder(default_model_path()).encode(texts)
    q8 = TextEncoder(default_model_path(), quantize="int8")
    assert any("quantized" in type(m).__module__ for m in q8.model.modules())
    int8 = q8.encode(texts)
    np.testing.assert_allclose(np.linalg.norm(int8, axis=1), 1.0, rtol=1e-4)
    cos = (fp32 * int8).sum(axis=1)
    assert cos.min() > 0.95, cos
    # the nearest fp32 neighbour of each int8 vector is its own text
    assert ((int8 @ fp32.T).argmax(axis=1) == np.arange(len(texts))).all()


def test_encoder_matches_sentence_transformers():
    """Independent reference: our transformers-only encoder = SentenceTransformer.encode."""
    from sentence_transformers import SentenceTransformer
    from retriever_server.dense_index import default_model_path
    from retriever_server.encoder import TextEncoder
    texts = ["a short query", "\"Title\"\nA longer passage about a city founded in 1849 by a river."] * 3
    ours = TextEncoder(default_model_path()).encode(texts, batch_size=4)
    ref = SentenceTransformer(str(default_model_path()), device="cpu").encode(
        texts, normalize_embeddings=True, convert_to_numpy=True)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_faiss_index_kinds_find_the_query_vector(kind):
    """Each --faiss kind, on random unit vectors: searching a stored vector returns it first."""
    import faiss
    from retriever_server.dense_index import _make_faiss_index
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    index, params = _make_faiss_index(kind, 32, len(x), hnsw_m=16, ivf_nlist=None)
    if kind == "ivf":
        assert params["ivf_nlist"] == min(int(4 * np.sqrt(2000)), 2000 // 39)
        index.train(x)
        faiss.extract_index_ivf(index).nprobe = 8
    index.add(x)
    scores, rows = index.search(x[:200], 3)
    assert (rows[:, 0] == np.arange(200)).mean() >= 0.95
    np.testing.assert_allclose(scores[rows[:, 0] == np.arange(200), 0], 1.0, atol=1e-4)
    with pytest.raises(ValueError, match="allowed values"):
        _make_faiss_index("lsh", 32, 10, 16, None)
