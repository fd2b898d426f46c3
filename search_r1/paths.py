"""Where the project keeps generated data, indexes and converted models.

Everything lives under `$SEARCH_R1_HOME` (default `~/.cache/search-r1`) so that a run from any
directory finds what an earlier run built. Tests point `SEARCH_R1_HOME` at a temp dir.
"""
from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("SEARCH_R1_HOME", Path.home() / ".cache" / "search-r1")).expanduser()


def default_synth_dir() -> Path:
    """Default synthetic QA world: corpus.jsonl, train/test parquet and jsonl, bm25 index."""
    return home() / "synth" / "default"


def model_cache_dir() -> Path:
    """Converted models (GGUF -> safetensors HF directories)."""
    return home() / "models"
