"""Index slices and their merge, IVF-PQ, memory-mapped loading and the --faiss-gpu error, on random
vectors (no encoder): the sharded search must be exactly the unsharded one."""
import numpy as np
import pytest

from retriever_server.shards import SliceSearcher, flat_rows, merge_topk, slice_bounds, to_gpus


def unit(n: int, d: int, seed: int = 0, clusters: int = 0, rank: int = 0) -> np.ndarray:
    """n unit vectors; with `clusters`, drawn around that many random centres, and with `rank`, varying
    mostly in a `rank`-dimensional subspace (real embeddings are clustered and of low intrinsic
    dimension; i.i.d. Gaussian vectors are PQ's worst case)."""
    rng = np.random.default_rng(seed)
    if rank:
        basis = np.random.default_rng(99).standard_normal((rank, d)).astype(np.float32)
        x = rng.standard_normal((n, rank)).astype(np.float32) @ basis + 0.1 * rng.standard_normal((n, d))
    else:
        x = rng.standard_normal((n, d)).astype(np.float32)
    if clusters:
        centres = np.random.default_rng(98).standard_normal((clusters, d)).astype(np.float32) * 2.0
        x = x + centres[rng.integers(0, clusters, n)]
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_merge_topk_equals_a_full_sort():
    """Against an independent reference: sort all candidates by (-score, row) in Python."""
    rng = np.random.default_rng(1)
    b, k = 6, 5
    parts = []
    for start in (0, 100, 200):
        scores = np.round(rng.standard_normal((b, k)), 1).astype(np.float32)  # rounding makes ties
        rows = rng.integers(0, 100, (b, k)) + start
        rows[0, -2:] = -1                                                       # missing hits
        parts.append((scores, rows))
    got_s, got_r = merge_topk(parts, k)
    for i in range(b):
        cand = sorted((-s, r) for p in parts for s, r in zip(p[0][i], p[1][i]) if r >= 0)[:k]
        assert got_r[i].tolist() == [r for _, r in cand]
        np.testing.assert_allclose(got_s[i], [-s for s, _ in cand])
    # L2: smaller is better
    s_l2, r_l2 = merge_topk([(np.array([[0.5, 2.0]], np.float32), np.array([[1, 2]])),
                             (np.array([[0.1, 3.0]], np.float32), np.array([[7, 8]]))], 3, larger_is_better=False)
    assert r_l2.tolist() == [[7, 1, 2]] and s_l2.tolist() == [[pytest.approx(0.1), 0.5, 2.0]]
    # fewer hits than k: the missing ones come last with row -1
    s, r = merge_topk([(np.array([[0.9]], np.float32), np.array([[-1]])),
                       (np.array([[0.2]], np.float32), np.array([[4]]))], 2)
    assert r.tolist() == [[4, -1]]


def test_slice_bounds():
    assert slice_bounds(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert slice_bounds(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="more than the 2 passages"):
        slice_bounds(2, 3)


@pytest.mark.parametrize("kind", ["flat", "ivf", "ivfpq", "hnsw"])
def test_sharded_search_equals_unsharded(kind):
    """K slices (a trained template cloned per slice, as `build --shards` does) merged = one index.
    HNSW graphs differ per slice, so there the merge is compared with a search of the slices' union."""
    import faiss

    from retriever_server.dense_index import _make_faiss_index, set_search_params
    faiss.omp_set_num_threads(1)
    x, q = unit(6000, 32, clusters=40), unit(50, 32, seed=2, clusters=40)
    template, _ = _make_faiss_index(kind, 32, len(x), hnsw_m=16, ivf_nlist=40, pq_m=8)
    if not template.is_trained:
        template.train(x)
    whole = faiss.clone_index(template)
    whole.add(x)
    parts = []
    for start, end in slice_bounds(len(x), 3):
        index = faiss.clone_index(template)
        index.add(x[start:end])
        set_search_params(index, nprobe=8, ef_search=64)
        parts.append(SliceSearcher(index, start, "faiss").search(q, 10))
    scores, rows = merge_topk(parts, 10)
    if kind == "hnsw":
        for i in range(len(q)):
            cand = {r: s for p in parts for r, s in zip(p[1][i], p[0][i])}
            assert rows[i].tolist() == sorted(cand, key=lambda r: (-cand[r], r))[:10]
        return
    set_search_params(whole, nprobe=8, ef_search=64)
    ref_s, ref_r = whole.search(q, 10)
    assert (rows == ref_r).all()
    np.testing.assert_allclose(scores, ref_s, rtol=1e-5, atol=1e-6)


def test_flat_rows_and_bf16_slices_equal_faiss():
    """Serve-time cuts of one Flat file (`serve --ray --shards K` on an imported index), searched with
    the bf16 screen, merge to faiss's own unsharded answer."""
    import faiss
    faiss.omp_set_num_threads(1)
    x, q = unit(3000, 48), unit(20, 48, seed=5)
    whole = faiss.IndexFlatIP(48)
    whole.add(x)
    parts = []
    for start, end in slice_bounds(len(x), 4):
        part = flat_rows(whole, start, end)
        assert part.ntotal == end - start
        parts.append(SliceSearcher(part, start, "bf16").search(q, 7))
    scores, rows = merge_topk(parts, 7)
    ref_s, ref_r = whole.search(q, 7)
    assert (rows == ref_r).all()
    np.testing.assert_allclose(scores, ref_s, atol=1e-5)
    ivf = faiss.index_factory(48, "IVF8,Flat", faiss.METRIC_INNER_PRODUCT)
    with pytest.raises(ValueError, match="build --shards"):
        flat_rows(ivf, 0, 10)


def test_ivfpq_recall_and_size():
    """IVF-PQ on clustered vectors: most of Flat's top-10 at a fraction of its bytes."""
    import faiss

    from retriever_server.dense_index import _make_faiss_index, default_pq_m, set_search_params
    faiss.omp_set_num_threads(1)
    d = 64
    x, q = unit(8000, d, clusters=50, rank=8), unit(200, d, seed=3, clusters=50, rank=8)
    index, params = _make_faiss_index("ivfpq", d, len(x), 16, None)
    assert params == {"ivf_nlist": min(int(4 * np.sqrt(8000)), 8000 // 39), "pq_m": default_pq_m(d), "pq_nbits": 8}
    index.train(x)
    index.add(x)
    set_search_params(index, nprobe=32, ef_search=64)
    flat = faiss.IndexFlatIP(d)
    flat.add(x)
    _, ref = flat.search(q, 10)
    _, got = index.search(q, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ref, got)])
    assert recall >= 0.8, recall
    size = faiss.serialize_index(index).nbytes / faiss.serialize_index(flat).nbytes
    assert size < 0.25, size   # 16 code bytes + 8 id bytes per vector vs 256 bytes
    with pytest.raises(ValueError, match="must divide"):
        _make_faiss_index("ivfpq", 30, 5000, 16, None, pq_m=7)
    with pytest.raises(ValueError, match="more passages"):
        _make_faiss_index("ivfpq", 32, 100, 16, None)


def test_memory_mapped_slices(tmp_path):
    """--mmap: the vectors are the file's pages, not a private copy, and the answers are the same."""
    import faiss

    from retriever_server.shards import read_faiss
    x = unit(20000, 64)
    flat = faiss.IndexFlatIP(64)
    flat.add(x)
    faiss.write_index(flat, str(tmp_path / "f.faiss"))

    def anon_kb() -> int:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))
    before = anon_kb()
    mapped = read_faiss(tmp_path / "f.faiss", mmap=True)
    assert anon_kb() - before < 0.25 * x.nbytes / 1024            # 5 MB of vectors, not in private memory
    assert SliceSearcher(mapped, 0, "auto", mmap=True).flat_search == "faiss"
    np.testing.assert_array_equal(mapped.search(x[:5], 3)[1], flat.search(x[:5], 3)[1])


def test_faiss_gpu_fails_clearly_without_gpu_faiss(tmp_path, capsys):
    import faiss
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        pytest.skip("this machine has GPU faiss")
    with pytest.raises(ValueError, match="faiss-gpu") as exc:
        to_gpus(faiss.IndexFlatIP(8))
    assert "--faiss-gpu" in str(exc.value) and "faiss-cpu" in str(exc.value)
    # the CLI fails before encoding anything, with one line
    from retriever_server.__main__ import main
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "contents": "a"}\n')
    with pytest.raises(SystemExit) as code:
        main(["build", "--corpus", str(corpus), "--kind", "dense", "--out", str(tmp_path / "o"), "--faiss-gpu"])
    assert code.value.code == 2 and "--faiss-gpu" in capsys.readouterr().err


def test_automatic_bf16_screen_only_when_its_copy_fits(monkeypatch):
    """flat_search=auto builds the bf16 copy (2*d bytes per passage) only up to 1/4 of RAM: wiki-18
    with e5 would need 32 GB more."""
    import faiss

    import retriever_server.shards as shards
    from retriever_server.cpu import has_native_bf16
    index = faiss.IndexFlatIP(32)
    index.add(unit(1000, 32))
    copy_bytes = 2 * 1000 * 32
    monkeypatch.setattr(shards, "total_ram", lambda: 4 * copy_bytes - 1)
    assert SliceSearcher(index, 0, "auto").flat_search == "faiss"
    monkeypatch.setattr(shards, "total_ram", lambda: 4 * copy_bytes)
    assert SliceSearcher(index, 0, "auto").flat_search == ("bf16" if has_native_bf16() else "faiss")
    assert SliceSearcher(index, 0, "bf16").flat_search == "bf16"      # asked for: always
