"""`python -m retriever_server`: help, build errors, defaults, and the zero-argument default corpus."""
import json
import subprocess
import sys

import requests

from retriever_server.__main__ import build_parser
from retriever_server.indexes import default_synth_dir
from tests._fixtures.retriever import REPO, RetrieverHandle, _env


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "retriever_server", *args], cwd=REPO, env=_env(env),
                          capture_output=True, text=True, timeout=120)


def test_help_explains_every_flag():
    serve = run("serve", "--help")
    assert serve.returncode == 0
    for flag in ("--index", "--host", "--port", "--api-key", "--topk", "--max-topk", "--max-queries",
                 "--max-query-chars", "--max-body-bytes", "--max-ids", "--batch-window-ms", "--max-batch",
                 "--workers", "--torch-threads", "--faiss-threads", "--quantize", "--flat-search", "--rrf-k",
                 "--rrf-depth", "--mmap", "--faiss-gpu", "--ray", "--ray-address", "--shards", "--replicas",
                 "--ingress-replicas", "--shard-cpus", "--shard-memory-gb", "--shard-timeout-s", "--shard-retries"):
        assert flag in serve.stdout, flag
    build = run("build", "--help")
    for flag in ("--corpus", "--kind", "--out", "--model", "--faiss", "--hnsw-m", "--ivf-nlist", "--force",
                 "ivfpq", "--pq-m", "--pq-nbits", "--shards", "--faiss-gpu", "--convention", "--pooling",
                 "--query-prefix", "--passage-prefix", "--normalize"):
        assert flag in build.stdout, flag
    imp = run("import", "--help")
    for flag in ("--faiss", "--corpus", "--out", "--model", "--verify", "--convention", "--no-normalize"):
        assert flag in imp.stdout, flag


def test_serve_defaults():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.topk == 3 and args.rrf_k == 60
    assert args.index == [] and args.quantize == "none" and args.flat_search == "auto"
    assert args.workers == args.torch_threads == args.faiss_threads == args.max_batch == "auto"


def test_auto_flags(monkeypatch):
    """Dense: one single-threaded batch of <= 64 queries per CPU in flight; BM25: one batch of <= 256;
    explicit flags win."""
    from retriever_server.cpu import resolve_auto
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    parse = lambda *a: build_parser().parse_args(["serve", *a])  # noqa: E731
    for kinds, flags, want in [
            (["dense"], [], (4, 1, 1, 64)),
            (["bm25", "dense"], [], (4, 1, 1, 64)),
            (["bm25"], [], (1, 4, 4, 256)),
            (["dense"], ["--processes", "2"], (2, 1, 1, 64)),
            (["dense"], ["--workers", "1", "--max-batch", "128"], (1, 4, 4, 128)),
            (["dense"], ["--workers", "2", "--torch-threads", "3"], (2, 3, 2, 64))]:
        args = parse(*flags)
        resolve_auto(args, kinds)
        assert (args.workers, args.torch_threads, args.faiss_threads, args.max_batch) == want, (kinds, flags)


def test_build_errors_are_one_clear_line(tmp_path, retriever_server):
    missing = run("build", "--corpus", str(tmp_path / "nope.jsonl"), "--kind", "bm25", "--out", str(tmp_path / "o"))
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    exists = run("build", "--corpus", str(retriever_server.corpus_path), "--kind", "bm25",
                 "--out", str(retriever_server.index_dir))
    assert exists.returncode == 2 and "--force" in exists.stderr
    bad_kind = run("build", "--corpus", "c", "--kind", "tfidf", "--out", "o")
    assert bad_kind.returncode == 2 and "invalid choice" in bad_kind.stderr
    not_index = run("serve", "--index", str(tmp_path))
    assert not_index.returncode == 2 and "manifest.json" in not_index.stderr


def test_default_dir_follows_search_r1_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SEARCH_R1_HOME", str(tmp_path))
    assert default_synth_dir() == tmp_path / "synth" / "default"
    from search_r1.paths import default_synth_dir as reference  # the rule this module repeats
    assert default_synth_dir() == reference()


def test_no_arguments_builds_and_serves_the_default_corpus(tmp_path):
    handle = RetrieverHandle([], log_path=tmp_path / "default.log", env={"SEARCH_R1_HOME": str(tmp_path)})
    # exactly `python -m retriever_server` plus a port (8000 may be taken on a shared machine)
    cmd = [sys.executable, "-m", "retriever_server", "serve", "--port", str(handle.port)]
    log = open(handle.log_path, "wb")
    handle.proc = subprocess.Popen(cmd, cwd=REPO, env=_env({"SEARCH_R1_HOME": str(tmp_path)}),
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        handle.wait_healthy(timeout=300)
        world = tmp_path / "synth" / "default"
        assert (world / "corpus.jsonl").exists() and (world / "index_bm25" / "manifest.json").exists()
        h = handle.health()
        assert h["kind"] == "bm25" and h["corpus_size"] > 100
        question = json.loads(open(world / "test.jsonl").readline())["question"]
        r = requests.post(handle.url, json={"queries": [question], "topk": 3}, timeout=30)
        assert r.status_code == 200 and len(r.json()["result"][0]) == 3
    finally:
        handle.stop()
        log.close()


def test_default_index_is_rebuilt_when_the_default_corpus_changes(monkeypatch, tmp_path):
    """A regenerated default world (another seed, another size) must not be served by the old index."""
    from retriever_server.indexes import ensure_default_index
    from retriever_server.manifest import file_sha256, read_manifest
    monkeypatch.setenv("SEARCH_R1_HOME", str(tmp_path))
    index_dir = ensure_default_index()
    corpus = default_synth_dir() / "corpus.jsonl"
    assert read_manifest(index_dir).corpus_sha256 == file_sha256(corpus)
    stamp = (index_dir / "manifest.json").stat().st_mtime_ns
    assert ensure_default_index() == index_dir
    assert (index_dir / "manifest.json").stat().st_mtime_ns == stamp  # same corpus: reused, not rebuilt
    # `--retriever-index default` (search_r1.evaluation and the agents) names this index; a directory passes through
    from search_r1.evaluation.runner import resolve_index_arg
    assert resolve_index_arg("default") == str(index_dir) and resolve_index_arg("idx/bm25") == "idx/bm25"
    lines = corpus.read_text().splitlines()
    corpus.write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    ensure_default_index()
    rebuilt = read_manifest(index_dir)
    assert rebuilt.corpus_sha256 == file_sha256(corpus) and rebuilt.corpus_size == len(lines) // 2
