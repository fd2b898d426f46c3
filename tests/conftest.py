"""Shared pytest setup: offline model loading, one thread per process (2-core machines)."""
import os

# Set before torch/transformers import anywhere in the test session.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# Shared fixtures live in small modules, one per room, so that parallel work does not collide here:
#   tests/_fixtures/synth.py      `synth_world`: a small generated QA world (corpus + parquet) per session
#   tests/_fixtures/retriever.py  `retriever_server`: the real HTTP retriever in a subprocess
#   tests/_fixtures/ray_session.py  `ray_session`: one local Ray cluster for the whole session
#   tests/_fixtures/budget.py     each test's time budget by marker (slow 180 s, others 60 s)
pytest_plugins = ["tests._fixtures.synth", "tests._fixtures.retriever", "tests._fixtures.ray_session",
                  "tests._fixtures.budget"]
