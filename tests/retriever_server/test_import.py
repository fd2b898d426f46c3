"""`python -m retriever_server import`: an index built the way upstream Search-R1 builds it (faiss
Flat, inner product, over mean-pooled normalized embeddings of "passage: " + contents) served as is.

The reference index is written here with sentence-transformers (not our encoder) and faiss's
index_factory, as upstream's index builder does; the served top-k must equal a direct faiss search
of sentence-transformers' "query: " + question embeddings.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import requests

from retriever_server.manifest import read_manifest
from tests._fixtures.encoders import model_variant
from tests._fixtures.retriever import REPO, _env

N_PASSAGES = 150


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "retriever_server", *map(str, args)], cwd=REPO,
                          env=_env({"TQDM_DISABLE": "1"}), capture_output=True, text=True, timeout=300)


def fails(capsys, *args) -> str:
    """The CLI's main() in this process (no interpreter start-up): exit 2, one line, no traceback."""
    from retriever_server.__main__ import main
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: "), err
    return err


@pytest.fixture(scope="module")
def upstream(synth_world, tmp_path_factory):
    """wiki-18 style corpus + e5_Flat.index made like upstream's builder, and the same model's queries."""
    import faiss
    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("upstream")
    model = model_variant(root, "e5-small-v2")
    lines = open(synth_world / "corpus.jsonl").read().splitlines()[:N_PASSAGES]
    corpus = root / "wiki-18.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    docs = [json.loads(line) for line in lines]
    st = SentenceTransformer(str(model), device="cpu")
    emb = st.encode([d["contents"] for d in docs], prompt="passage: ", convert_to_numpy=True,
                    normalize_embeddings=True, batch_size=32).astype(np.float32)
    index = faiss.index_factory(emb.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(emb)
    faiss.write_index(index, str(root / "e5_Flat.index"))
    questions = [json.loads(line)["question"] for line in open(synth_world / "test.jsonl")][:30]
    q = st.encode(questions, prompt="query: ", convert_to_numpy=True, normalize_embeddings=True)
    scores, rows = index.search(q.astype(np.float32), 5)
    return {"root": root, "model": model, "corpus": corpus, "faiss": root / "e5_Flat.index", "docs": docs,
            "questions": questions, "ref_scores": scores, "ref_rows": rows}


@pytest.fixture(scope="module")
def imported(upstream):
    out = upstream["root"] / "idx"
    proc = run_cli("import", "--faiss", upstream["faiss"], "--corpus", upstream["corpus"],
                   "--model", upstream["model"], "--out", out, "--torch-threads", "1")
    assert proc.returncode == 0, proc.stderr
    return out


def test_import_references_the_files_and_records_the_convention(upstream, imported):
    m = read_manifest(imported)
    assert m.kind == "dense" and m.corpus_size == N_PASSAGES
    p = m.params
    assert p["encoder"]["name"] == "e5" and p["faiss"] == "flat" and p["metric"] == "inner_product"
    assert p["slices"] == [{"path": str(upstream["faiss"].resolve()), "start": 0, "end": N_PASSAGES}]
    # nothing copied: no faiss file and no passage text in our directory
    files = [f.name for f in imported.rglob("*") if f.is_file()]
    assert not [f for f in files if f.endswith((".faiss", ".index", ".bin"))], files
    assert sum(f.stat().st_size for f in imported.rglob("*") if f.is_file()) < upstream["corpus"].stat().st_size


@pytest.mark.parametrize("flags", [{}, {"mmap": True}])
def test_served_top_k_equals_a_direct_faiss_search(upstream, imported, start_retriever, flags):
    server = start_retriever(imported, **flags)
    h = server.health()
    assert h["indexes"][0]["encoder"]["query_prefix"] == "query: "
    if flags:
        assert h["indexes"][0]["flat_search"] == "faiss"   # mmap: no bf16 RAM copy
    r = requests.post(server.url, json={"queries": upstream["questions"], "topk": 5, "return_scores": True},
                      timeout=120)
    assert r.status_code == 200, r.text
    for hits, rows, scores in zip(r.json()["result"], upstream["ref_rows"], upstream["ref_scores"]):
        assert [x["document"]["id"] for x in hits] == [upstream["docs"][i]["id"] for i in rows]
        assert [x["document"]["contents"] for x in hits] == [upstream["docs"][i]["contents"] for i in rows]
        np.testing.assert_allclose([x["score"] for x in hits], scores, atol=1e-4)
    doc = upstream["docs"][7]
    a = requests.post(server.base_url + "/access", json={"ids": [doc["id"], "nope"]}, timeout=30).json()
    assert a == {"result": [doc, None], "missing": ["nope"]}


def test_import_errors_name_both_numbers(upstream, tmp_path, capsys):
    import faiss
    longer = tmp_path / "longer.jsonl"
    longer.write_text(upstream["corpus"].read_text() + json.dumps({"id": "extra", "contents": "x"}) + "\n")
    err = fails(capsys, "import", "--faiss", upstream["faiss"], "--corpus", longer, "--model", upstream["model"],
                "--out", tmp_path / "a", "--torch-threads", "1")
    assert f"holds {N_PASSAGES} vectors" in err and f"has {N_PASSAGES + 1} rows" in err
    small = faiss.IndexFlatIP(32)
    small.add(np.zeros((N_PASSAGES, 32), np.float32))
    faiss.write_index(small, str(tmp_path / "d32.index"))
    err = fails(capsys, "import", "--faiss", tmp_path / "d32.index", "--corpus", upstream["corpus"],
                "--model", upstream["model"], "--out", tmp_path / "b", "--torch-threads", "1")
    assert "32-dimensional" in err and "384-dimensional" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()   # nothing half-written
    assert not list(tmp_path.glob(".*tmp*"))


def test_import_with_the_wrong_convention_is_refused(upstream, tmp_path, capsys):
    """Passages re-encoded without e5's "passage: " prefix (or with CLS pooling) are not the stored
    vectors: import says so instead of serving wrong neighbours."""
    for flags in (["--convention", "st"], ["--pooling", "cls"]):
        err = fails(capsys, "import", "--faiss", upstream["faiss"], "--corpus", upstream["corpus"],
                    "--model", upstream["model"], "--out", tmp_path / "x", "--torch-threads", "1", *flags)
        assert "--verify" in err and "relative difference" in err, err


def test_changed_corpus_is_detected_at_serve_time(upstream, tmp_path, capsys):
    import shutil

    from retriever_server.__main__ import main
    corpus = tmp_path / "c.jsonl"
    shutil.copy(upstream["corpus"], corpus)
    out = tmp_path / "idx"
    main(["import", "--faiss", str(upstream["faiss"]), "--corpus", str(corpus), "--model", str(upstream["model"]),
          "--out", str(out), "--verify", "0", "--torch-threads", "1"])
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "late", "contents": "appended"}) + "\n")
    err = fails(capsys, "serve", "--index", out, "--port", "1", "--torch-threads", "1", "--faiss-threads", "1")
    assert "changed since it was imported" in err
