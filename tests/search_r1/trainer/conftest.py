"""Fixtures of the trainer tests: one Ray session for the whole test session (Ray starts slowly on
2 cores), and a PolicyWorker built in this process (no Ray) for fast math tests."""
import os

import pytest

from search_r1.net import free_port


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


@pytest.fixture
def local_worker_factory():
    """Build PolicyWorker(spec) in-process as rank 0 of 1 (verl's Worker reads these env vars)."""
    from search_r1.trainer.workers import PolicyWorker

    keys = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "WG_BACKEND", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "REDIS_STORE_SERVER_HOST")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      WG_BACKEND="ray")

    def make(spec):
        worker = PolicyWorker(spec)
        worker.init_model()
        return worker

    yield make
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
