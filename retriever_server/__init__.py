"""Search-R1 retriever service: `python -m retriever_server build|serve` (see `__main__`).

Rooms:
    corpus_store.py  memory-mapped documents (contents + ids as byte blobs with int64 offsets, id
                     lookup by sorted 64-bit hashes): no Python object per document
    bm25_index.py    bm25s index build/save/load; exact batched top-k with MaxScore-style pruning
    encoder.py       transformers-only text encoder (sentence-transformers pooling), optional int8
    dense_index.py   faiss flat/hnsw/ivf over normalized embeddings (inner product = cosine)
    fusion.py        reciprocal-rank fusion of several rankings (hybrid BM25 + dense)
    batcher.py       cross-request micro-batching onto a thread pool, off the event loop
    app.py           FastAPI app: /retrieve (upstream Search-R1 shape), /access, /health, limits, auth
    manifest.py      manifest.json of an index directory (kind, corpus fingerprint, build params)

Imports nothing from `search_r1`: the service and the trainer are separate processes that share
only the HTTP API.
"""
