"""`ray_session`: one local Ray cluster for the whole test session (Ray starts slowly on 2 cores).

Every test that needs Ray uses this fixture: a second `ray.init` in the same session fails ("called
ray.init twice"), so a module must never start its own cluster. A test that needs a fresh worker
process gives its task a runtime_env of its own (Ray reuses a worker only for the same runtime_env).
"""
import os

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    started = False
    if not ray.is_initialized():
        os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's default 15 starves workers on a busy box
        # 4 logical CPUs: a DP=1 and a DP=2 group side by side (one bundle each); torch threads stay 1.
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})
        started = True
    yield ray
    if started:
        ray.shutdown()
