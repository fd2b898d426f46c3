"""The served BM25 retriever over the synthetic world: upstream-compatible shapes, recall, /access,
/health, OpenAPI, concurrent load. Real subprocess server, real HTTP."""
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests


def post(server, path, body, **kw):
    return requests.post(server.base_url + path, json=body, timeout=30, **kw)


def test_return_scores_true_has_upstream_shape(retriever_server):
    r = post(retriever_server, "/retrieve", {"queries": ["Where was someone born?", "company founded"],
                                             "topk": 2, "return_scores": True})
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert len(result) == 2
    for hits in result:
        assert len(hits) == 2
        for hit in hits:
            assert set(hit) == {"document", "score"}
            assert set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["document"]["id"], str) and isinstance(hit["score"], float)
            assert hit["document"]["contents"].startswith('"')  # "Title"\ntext, the wiki-18 format
        assert hits[0]["score"] >= hits[1]["score"]


def test_return_scores_false_returns_documents_only(retriever_server):
    # upstream crashes on return_scores=false; we return the documents without the score wrapper
    r = post(retriever_server, "/retrieve", {"queries": ["river city"], "topk": 3, "return_scores": False})
    assert r.status_code == 200, r.text
    (hits,) = r.json()["result"]
    assert len(hits) == 3 and all(set(h) == {"id", "contents"} for h in hits)


def test_topk_null_and_missing_use_default_3(retriever_server):
    for body in ({"queries": ["city river"], "topk": None}, {"queries": ["city river"]}):
        r = post(retriever_server, "/retrieve", body)
        assert r.status_code == 200 and len(r.json()["result"][0]) == 3


def test_documents_and_scores_match_the_corpus(retriever_server):
    corpus = {}
    with open(retriever_server.corpus_path) as f:
        for line in f:
            rec = json.loads(line)
            corpus[rec["id"]] = rec["contents"]
    doc_id, contents = next(iter(corpus.items()))
    title = contents.split("\n")[0].strip('"')
    r = post(retriever_server, "/retrieve", {"queries": [title], "topk": 5, "return_scores": True})
    hits = r.json()["result"][0]
    assert all(corpus[h["document"]["id"]] == h["document"]["contents"] for h in hits)
    assert any(title in h["document"]["contents"] for h in hits)


def test_recall_at_3_single_hop(retriever_server):
    """The passage a single-hop question was made from (gold_doc_ids) is in the top 3."""
    test_jsonl = Path(retriever_server.corpus_path).parent / "test.jsonl"
    train_jsonl = Path(retriever_server.corpus_path).parent / "train.jsonl"
    rows = [json.loads(line) for p in (test_jsonl, train_jsonl) for line in open(p)]
    single = [r for r in rows if r["data_source"] == "synth_nq"][:200]
    assert len(single) >= 20
    r = post(retriever_server, "/retrieve", {"queries": [q["question"] for q in single], "topk": 3})
    hits = r.json()["result"]
    found = sum(bool({d["id"] for d in h} & set(q["gold_doc_ids"])) for q, h in zip(single, hits))
    assert found / len(single) >= 0.8, f"recall@3 = {found}/{len(single)}"


def test_access_returns_whole_documents_and_nulls_for_unknown_ids(retriever_server):
    with open(retriever_server.corpus_path) as f:
        first, second = (json.loads(next(f)) for _ in range(2))
    r = post(retriever_server, "/access", {"ids": [second["id"], "no-such-id", first["id"]]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["result"][0] == {"id": second["id"], "contents": second["contents"]}
    assert body["result"][1] is None
    assert body["result"][2]["contents"] == first["contents"]
    assert body["missing"] == ["no-such-id"]


def test_health_reports_kind_size_uptime_counters(retriever_server):
    n_docs = sum(1 for line in open(retriever_server.corpus_path) if line.strip())
    h = retriever_server.health()
    assert h["status"] == "ok" and h["kind"] == "bm25" and h["corpus_size"] == n_docs
    assert h["uptime_s"] > 0 and h["counters"]["requests"] >= 1
    assert h["limits"]["default_topk"] == 3 and h["auth"] is False
    assert h["indexes"][0]["kind"] == "bm25"


def test_openapi_spec_describes_the_endpoints(retriever_server):
    spec = requests.get(retriever_server.base_url + "/openapi.json", timeout=10).json()
    assert {"/retrieve", "/access", "/health"} <= set(spec["paths"])
    props = spec["components"]["schemas"]["RetrieveRequest"]["properties"]
    assert {"queries", "topk", "return_scores"} <= set(props)


def test_form_encoded_json_body_is_accepted(retriever_server):
    # `curl -d '{...}'` sends application/x-www-form-urlencoded; the body is still JSON
    r = requests.post(retriever_server.url, data='{"queries": ["city"], "topk": 1}', timeout=10,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 1


def _hammer(server, questions, threads=8, requests_per_thread=20, batch=4):
    """`threads` clients x `requests_per_thread` POSTs of `batch` queries; returns (status, ok) pairs."""
    def worker(t):
        session = requests.Session()
        statuses = []
        for i in range(requests_per_thread):
            start = (t * requests_per_thread + i) % (len(questions) - batch)
            qs = questions[start:start + batch]
            r = session.post(server.url, json={"queries": qs, "topk": 3}, timeout=30)
            statuses.append((r.status_code, r.status_code == 200 and len(r.json()["result"]) == len(qs)))
        return statuses

    with ThreadPoolExecutor(threads) as pool:
        return [s for part in pool.map(worker, range(threads)) for s in part]


def _questions(server):
    return [json.loads(line)["question"] for line in open(Path(server.corpus_path).parent / "train.jsonl")][:320]


def test_concurrent_load_without_errors_and_batching_happens(retriever_server):
    before = retriever_server.health()["batching"]
    assert _hammer(retriever_server, _questions(retriever_server)) == [(200, True)] * 160
    after = retriever_server.health()["batching"]
    assert after["batched_queries"] - before["batched_queries"] == 160 * 4
    # concurrent requests shared index lookups: fewer batches than requests
    assert after["batches"] - before["batches"] < 160


def test_concurrent_load_with_two_search_threads_and_tiny_batches(retriever_server, start_retriever):
    # two batches in flight at once, and max_batch smaller than a request (requests get split)
    server = start_retriever([retriever_server.index_dir], workers=2, max_batch=3, batch_window_ms=5)
    server.corpus_path = retriever_server.corpus_path
    questions = _questions(retriever_server)
    assert _hammer(server, questions, threads=6, requests_per_thread=10) == [(200, True)] * 60
    # split requests come back in order: same answers as the one-batch server
    qs = questions[:7]
    mine = requests.post(server.url, json={"queries": qs}, timeout=30).json()
    ref = requests.post(retriever_server.url, json={"queries": qs}, timeout=30).json()
    assert mine == ref
    assert server.health()["batching"]["max_batch_queries"] <= 3


def test_binds_loopback_by_default(retriever_server):
    conns = psutil.Process(retriever_server.proc.pid).net_connections(kind="tcp")
    listening = [c.laddr for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening)


def test_several_processes_share_the_port(retriever_server, start_retriever):
    server = start_retriever([retriever_server.index_dir], processes=2)
    parent = psutil.Process(server.proc.pid)
    assert len([p for p in parent.children(recursive=True) if "python" in p.name().lower()]) >= 2
    assert _hammer(server, _questions(retriever_server), threads=6, requests_per_thread=10) == [(200, True)] * 60
    pids = {requests.Session().get(server.base_url + "/health", timeout=10).json()["pid"] for _ in range(30)}
    assert pids <= {p.pid for p in parent.children(recursive=True)}
    children = parent.children(recursive=True)
    server.stop()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, "worker processes outlived the server"
