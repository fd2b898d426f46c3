"""What an evaluation's predictions depend on beyond its flags, resolved: `resolved_identity`.

`--model outputs/demo` names whatever checkpoint that run directory holds today, so the flags alone
cannot tell a resumed evaluation that the model changed under it. The resume check
(`runner._prepare_out_dir`) compares these fingerprints too:

    model       the directory or file the name resolved to, and sha256 over its weight files
                (for --base-url: the served model name and the server URL; its weights are remote)
    tokenizer   its source and sha256 over its vocabulary, special tokens and chat template
    template    sha256 of the prompt template of the mode (chat template + the baseline instruction)
    data        sha256 of each data file
    retriever   the index directory and its manifest (kind, corpus sha256, build parameters), or the
                server URLs and what the first answering server reports (/health: kind, corpus size)
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from search_r1.search.base import SearchError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def files_sha256(paths) -> str:
    """sha256 over (name, bytes) of each file, in name order."""
    h = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def model_identity(model_dir: str) -> dict:
    """The local weights `model_dir` (an already resolved name: alias, HF directory, GGUF file or
    cached hub id) points at: their path and sha256 over the weight files."""
    from search_r1.models import resolve_model_path

    path = Path(model_dir).expanduser()
    if path.is_file():  # a .gguf: the file itself is the identity (not its converted cache)
        return {"path": str(path.resolve()), "weights_sha256": files_sha256([path])}
    resolved = Path(resolve_model_path(model_dir))
    weights = [p for p in resolved.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    if not weights:
        raise ValueError(f"{resolved} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    return {"path": str(resolved), "weights_sha256": files_sha256(weights)}


def tokenizer_identity(tokenizer) -> dict:
    """Source and sha256 of what decides the token ids: vocabulary, special tokens, chat template."""
    content = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(tokenizer.all_special_tokens),
               "chat_template": getattr(tokenizer, "chat_template", None)}
    digest = hashlib.sha256(json.dumps(content, ensure_ascii=False).encode()).hexdigest()
    return {"source": str(getattr(tokenizer, "name_or_path", "")), "sha256": digest}


def template_sha256(tokenizer, mode: str) -> str:
    """The prompt template of `mode`: the chat template, plus the baselines' instruction text (the
    search mode's instruction is in the data's own prompt)."""
    from search_r1.prompts import NO_SEARCH_INSTRUCTION, RAG_INSTRUCTION

    instruction = {"no_search": NO_SEARCH_INSTRUCTION, "rag": RAG_INSTRUCTION}.get(mode, "")
    text = json.dumps([getattr(tokenizer, "chat_template", None), instruction], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def retriever_identity(mode: str, index: str | None, engine) -> dict | None:
    """The index served for the run, or the running servers the engine talks to (None without
    search). A search engine none of whose servers answers fails here, before any rollout."""
    if mode == "no_search":
        return None
    if index:
        from retriever_server.manifest import read_manifest

        m = read_manifest(index)
        return {"index": str(Path(index).expanduser().resolve()), "kind": m.kind, "corpus_sha256": m.corpus_sha256,
                "corpus_size": m.corpus_size, "params": m.params, "built_at": m.built_at}
    urls = getattr(engine, "urls", None)
    if not urls:
        return {"engine": type(engine).__name__}
    import httpx

    from search_r1.search.retriever_client import check_reachable

    errors = []
    for url in urls:
        try:
            check_reachable(url)
            health = httpx.get(url.removesuffix("/retrieve") + "/health", timeout=5.0).json()
            return {"urls": list(urls), "kind": health.get("kind"), "corpus_size": health.get("corpus_size")}
        except (SearchError, httpx.HTTPError, ValueError) as exc:
            errors.append(str(exc))
    raise SearchError(f"{errors[0]}. Fix: start it (`python -m retriever_server serve --index DIR --port PORT`) "
                      f"and pass --retriever-url, or pass --retriever-index DIR to serve an index for this run")


def resolved_identity(cfg, tokenizer, model_dir: str | None, engine) -> dict:
    """Fingerprints of everything the predictions depend on beyond cfg's flags (module docstring).
    model_dir: the resolved local model (None when a generator was handed in, or with base_url)."""
    if cfg.base_url:
        model = {"served": cfg.model, "base_url": cfg.base_url}
    elif model_dir is not None:
        model = model_identity(model_dir)
    else:
        model = {"given": cfg.model}  # evaluate(generator=...): the caller vouches for it
    return {"model": model, "tokenizer": tokenizer_identity(tokenizer), "template_sha256": template_sha256(tokenizer, cfg.mode),
            "data_sha256": {str(p): files_sha256([p]) for p in cfg.data},
            "retriever": retriever_identity(cfg.mode, cfg.retriever_index, engine)}
