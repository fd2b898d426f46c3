"""Encoder conventions (e5 / bge / st / dpr): picked by name, overridden by flags, recorded in the
manifest, and encoded exactly as sentence-transformers (an independent implementation) encodes
with the same prompt, pooling and normalization.

The encoders are the bundled MiniLM weights under each family's name and pooling
(tests/_fixtures/encoders.py says why no real bge / e5 model is used).
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from retriever_server.conventions import (BGE_EN_INSTRUCTION, BGE_ZH_INSTRUCTION, EncoderConvention,
                                          family_of, resolve_convention)
from retriever_server.dense_index import default_model_path
from tests._fixtures.encoders import model_variant as variant

TEXTS = ["who founded the city on the river", "\"Velmora\"\nVelmora lies on the banks of a river.",
         "a much longer passage " * 20]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"e5": variant(root, "e5-small-v2"), "bge": variant(root, "bge-small-en-v1.5", "cls"),
            "dpr": variant(root, "dpr-question_encoder-single", "cls", normalize=False),
            "st": default_model_path()}


@pytest.mark.parametrize("name,family", [
    ("intfloat/e5-base-v2", "e5"), ("intfloat/multilingual-e5-small", "e5"), ("e5_flat", "e5"),
    ("baai/bge-small-en-v1.5", "bge"), ("bge-m3", "bge"), ("facebook/dpr-ctx_encoder-single-nq-base", "dpr"),
    ("sentence-transformers/all-minilm-l6-v2", "st"), ("nreimers/minilm-l6-h384-uncased", "st"),
    ("ge5t-model", "st"), ("abge", "st")])   # the family is a word of the name, not any substring
def test_family_by_name(name, family):
    assert family_of(name) == family


def test_conventions_by_name_and_flags(models, tmp_path):
    e5 = resolve_convention(models["e5"])
    assert e5 == EncoderConvention("e5", "query: ", "passage: ", "mean", True)
    bge = resolve_convention(models["bge"])
    assert bge == EncoderConvention("bge", BGE_EN_INSTRUCTION, "", "cls", True)
    assert resolve_convention(variant(tmp_path, "bge-large-zh-v1.5", "cls")).query_prefix == BGE_ZH_INSTRUCTION
    assert resolve_convention(variant(tmp_path, "bge-m3", "cls")).query_prefix == ""
    assert resolve_convention(models["dpr"]) == EncoderConvention("dpr", "", "", "cls", False)
    # st: what the directory declares (MiniLM: mean pooling, a Normalize module)
    assert resolve_convention(models["st"]) == EncoderConvention("st", "", "", "mean", True)
    # a name can be forced; single fields overridden (the name says so)
    assert resolve_convention(models["st"], "e5").query_prefix == "query: "
    custom = resolve_convention(models["e5"], pooling="cls", normalize=False, query_prefix="q: ")
    assert custom == EncoderConvention("e5+custom", "q: ", "passage: ", "cls", False)
    assert resolve_convention(models["e5"], pooling="mean").name == "e5"   # same value: no override
    with pytest.raises(ValueError, match="allowed values"):
        resolve_convention(models["st"], "colbert")
    with pytest.raises(ValueError, match="pooling"):
        resolve_convention(models["st"], pooling="last")


@pytest.mark.parametrize("family", ["e5", "bge", "dpr", "st"])
def test_encoder_equals_sentence_transformers(models, family):
    """Queries and passages, encoded by our transformers-only encoder with the convention, equal
    SentenceTransformer.encode with the same prompt on the same directory (its own pooling and
    Normalize module)."""
    import torch
    from sentence_transformers import SentenceTransformer

    from retriever_server.encoder import TextEncoder
    torch.set_num_threads(1)
    conv = resolve_convention(models[family])
    ours = TextEncoder(models[family], convention=conv)
    ref = SentenceTransformer(str(models[family]), device="cpu")
    for encode, prefix in ((ours.encode_queries, conv.query_prefix), (ours.encode_passages, conv.passage_prefix)):
        got = encode(TEXTS, 2)
        want = ref.encode(TEXTS, prompt=prefix or None, convert_to_numpy=True, batch_size=2)
        np.testing.assert_allclose(got, want, atol=2e-5)
    norms = np.linalg.norm(ours.encode_queries(TEXTS), axis=1)
    if conv.normalize:
        np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    else:  # DPR: raw CLS vectors, scored by plain inner product
        assert np.all(np.abs(norms - 1.0) > 0.05), norms


def test_prefix_and_pooling_change_the_vectors(models):
    """The conventions are not cosmetic: a missing prefix or another pooling moves the vectors."""
    import torch

    from retriever_server.encoder import TextEncoder
    torch.set_num_threads(1)
    e5 = TextEncoder(models["e5"], convention=resolve_convention(models["e5"]))
    plain = TextEncoder(models["e5"], convention=resolve_convention(models["e5"], "st"))
    cls = TextEncoder(models["e5"], convention=resolve_convention(models["e5"], pooling="cls"))
    base = e5.encode_passages(TEXTS)
    for other in (plain.encode_passages(TEXTS), cls.encode_passages(TEXTS)):
        assert (np.linalg.norm(base - other, axis=1) > 0.05).all()


def test_manifest_records_the_convention_and_the_server_encodes_by_it(models, synth_world, tmp_path):
    """`build --model e5-dir` encodes passages with "passage: " and records e5; the searcher loaded
    from that manifest encodes queries with "query: ": as upstream's builder and server do."""
    import torch

    from retriever_server.indexes import build_index
    from retriever_server.dense_index import DenseSearcher, check_model
    from retriever_server.encoder import TextEncoder
    from retriever_server.manifest import read_manifest
    torch.set_num_threads(1)
    lines = open(synth_world / "corpus.jsonl").read().splitlines()[:40]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    out = build_index(corpus, "dense", tmp_path / "idx", model=str(models["e5"]))
    params = read_manifest(out).params
    assert params["encoder"] == {"name": "e5", "query_prefix": "query: ", "passage_prefix": "passage: ",
                                 "pooling": "mean", "normalize": True}
    searcher = DenseSearcher(out, params, flat_search="faiss")
    raw = TextEncoder(models["e5"])   # no convention: texts as given
    np.testing.assert_allclose(searcher.encode(["where is it"]), raw.encode(["query: where is it"]), atol=1e-6)
    import faiss
    stored = faiss.read_index(str(out / "dense.faiss")).reconstruct(3)
    text = json.loads(lines[3])["contents"]
    np.testing.assert_allclose(stored, raw.encode(["passage: " + text])[0], atol=1e-5)
    # the index answers with its own passage for that passage's text, encoded as a query would be
    assert searcher.search([text], 1)[0][0][0] == 3
    # serving with another model is refused (the fingerprint in the manifest differs)
    other = tmp_path / "other-model"
    other.mkdir()
    for item in default_model_path().iterdir():
        if item.name != "config.json":
            os.symlink(item, other / item.name)
    cfg = json.loads((default_model_path() / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "layer_norm_eps": 1e-6}))
    with pytest.raises(ValueError, match="not the encoder this index was built with"):
        check_model(params, other, str(other))
    check_model(params, models["e5"], str(models["e5"]))   # the same model elsewhere: accepted
