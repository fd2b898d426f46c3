"""`serve --ray`: shards on Ray Serve in the session's local Ray cluster (tests/_fixtures/ray_session.py).

One application for the module (Serve start-up is the slow part on 2 cores): the dense index of the
synthetic corpus written as 3 slices by `build --shards 3`, 2 replicas per shard. Its answers must
equal one unsharded Flat search; a killed replica is replaced while the API keeps answering; a
shard with no live replica gives 503, never a partial top-k.
"""
import json
import time

import numpy as np
import pytest
import requests

pytestmark = pytest.mark.slow

K_SHARDS, REPLICAS = 3, 2


@pytest.fixture(scope="module")
def sharded(ray_session, synth_world, tmp_path_factory):
    import torch
    from ray import serve

    from retriever_server.__main__ import build_parser
    from retriever_server.indexes import build_index
    from retriever_server.launcher import free_port
    from retriever_server.ray_serve import APP_NAME, deploy
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("ray_serve")
    corpus = synth_world / "corpus.jsonl"
    t0 = time.time()
    sliced = build_index(corpus, "dense", root / "sliced", shards=K_SHARDS)
    t_build = time.time() - t0
    reference = UnshardedFlat(sliced)
    port = free_port()
    args = build_parser().parse_args([
        "serve", "--index", str(sliced), "--ray", "--replicas", str(REPLICAS), "--port", str(port),
        "--shard-cpus", "0.1", "--ingress-cpus", "0.1", "--torch-threads", "1", "--faiss-threads", "1",
        "--shard-timeout-s", "2", "--shard-retries", "1"])
    t0 = time.time()
    url = deploy(args)
    print(f"[test] builds {t_build:.0f}s, Serve deploy {time.time() - t0:.0f}s")
    questions = [json.loads(line)["question"] for line in open(synth_world / "test.jsonl")][:40]
    docs = [json.loads(line) for line in open(corpus)]
    yield {"url": url, "base": url.rsplit("/", 1)[0], "reference": reference, "questions": questions,
           "docs": docs, "sliced": sliced}
    serve.delete(APP_NAME)
    serve.shutdown()


class UnshardedFlat:
    """The reference: one faiss Flat index over all slices' vectors in row order, queries encoded by
    the server's own encoder."""

    def __init__(self, index_dir):
        import faiss

        from retriever_server.dense_index import DenseSearcher, load_slices
        from retriever_server.manifest import read_manifest
        params = read_manifest(index_dir).params
        self.encoder = DenseSearcher(index_dir, params, load_index=False)
        vectors = [part.reconstruct_n(0, part.ntotal) for part, _ in load_slices(index_dir, params)]
        self.index = faiss.IndexFlatIP(vectors[0].shape[1])
        self.index.add(np.concatenate(vectors))

    def search(self, queries, k):
        scores, rows = self.index.search(self.encoder.encode(queries), k)
        return list(zip(rows, scores))


def expected(sharded, queries, k):
    return [[sharded["docs"][r]["id"] for r in rows] for rows, _ in sharded["reference"].search(queries, k)]


def retrieve(sharded, queries, k=10, timeout=60):
    return requests.post(sharded["url"], json={"queries": queries, "topk": k, "return_scores": True},
                         timeout=timeout)


def replicas(deployment: str) -> list[str]:
    import ray
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in a["name"]]


def kill(name: str) -> None:
    import ray
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def test_sharded_search_equals_unsharded_flat(sharded):
    health = requests.get(sharded["base"] + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["shards"]["answering"] == K_SHARDS
    from retriever_server.shards import slice_bounds
    assert [tuple(d["rows"]) for d in health["shards"]["detail"]] == slice_bounds(len(sharded["docs"]), K_SHARDS)
    r = retrieve(sharded, sharded["questions"], k=10)
    assert r.status_code == 200, r.text
    got = r.json()["result"]
    ref = sharded["reference"].search(sharded["questions"], 10)
    for hits, (rows, scores) in zip(got, ref):
        assert [h["document"]["id"] for h in hits] == [sharded["docs"][i]["id"] for i in rows]
        np.testing.assert_allclose([h["score"] for h in hits], scores, atol=1e-5)
    # several concurrent requests are batched across requests (one encoder call, one fan-out)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda q: retrieve(sharded, [q], k=3), sharded["questions"][:16]))
    assert all(o.status_code == 200 for o in outs)
    assert [[h["document"]["id"] for h in o.json()["result"][0]] for o in outs] == \
        expected(sharded, sharded["questions"][:16], 3)
    assert requests.get(sharded["base"] + "/health", timeout=30).json()["batching"]["max_batch_queries"] > 1


def test_killed_replica_is_replaced_and_the_api_keeps_answering(sharded):
    """One of shard 1's two replicas dies: the other (and the shard retries) keep every request
    answered, and Serve starts a replacement."""
    before = replicas("shard-1")
    assert len(before) == REPLICAS
    kill(before[0])
    want = expected(sharded, sharded["questions"][:4], 5)
    statuses, wrong, t0 = [], 0, time.time()
    while time.time() - t0 < 90:
        r = retrieve(sharded, sharded["questions"][:4], k=5)
        statuses.append(r.status_code)
        if r.status_code == 200:
            wrong += [[h["document"]["id"] for h in hs] for hs in r.json()["result"]] != want
        now = replicas("shard-1")
        if len(now) == REPLICAS and before[0] not in now and len(statuses) >= 10:
            break
        time.sleep(0.2)
    errors = sum(s != 200 for s in statuses)
    print(f"[test] replica replaced after {time.time() - t0:.1f}s; {len(statuses)} requests, {errors} errors")
    assert before[0] not in replicas("shard-1") and len(replicas("shard-1")) == REPLICAS
    assert errors == 0 and wrong == 0


def test_down_shard_gives_503_never_a_partial_top_k(sharded):
    """Shard 2 has no live replica for 8 s (every replica Serve starts is killed too, longer than the
    ingress' retries wait): requests get 503 naming the shard, never the top-k of the other shards;
    once Serve's replicas stay up, complete answers again. The queries are passages of shard 2, so a
    partial top-k would visibly lack their own passage."""
    import threading
    from retriever_server.shards import slice_bounds
    start, end = slice_bounds(len(sharded["docs"]), K_SHARDS)[2]
    queries = [sharded["docs"][r]["contents"].split("\n", 1)[1] for r in range(start, end, 25)]
    want = expected(sharded, queries, 5)
    assert all(sharded["docs"][r]["id"] in w for r, w in zip(range(start, end, 25), want))
    outage_end = time.time() + 8.0

    def keep_shard_down():
        while time.time() < outage_end:
            for name in replicas("shard-2"):
                try:
                    kill(name)
                except ValueError:  # already gone
                    pass
            time.sleep(0.1)
    killer = threading.Thread(target=keep_shard_down, daemon=True)
    killer.start()
    time.sleep(0.3)
    seen, t0 = [], time.time()
    while time.time() - t0 < 120:
        r = retrieve(sharded, queries, k=5)
        seen.append(r.status_code)
        if r.status_code == 200:
            assert [[h["document"]["id"] for h in hs] for hs in r.json()["result"]] == want
            if 503 in seen:
                break
        else:
            assert r.status_code == 503, r.text
            detail = r.json()["detail"]
            assert f"{K_SHARDS - 1} of {K_SHARDS} shards answered" in detail and "[2]" in detail, detail
            assert r.headers["retry-after"]
    killer.join()
    print(f"[test] statuses after killing shard 2: {seen}")
    assert 503 in seen and seen[-1] == 200
    health = requests.get(sharded["base"] + "/health", timeout=30).json()
    assert health["counters"]["unavailable"] >= 1
