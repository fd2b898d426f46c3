"""Fixtures of the trainer tests: a PolicyWorker built in this process (no Ray) for fast math tests.
The Ray session they share with other rooms is `ray_session` (tests/_fixtures/ray_session.py)."""
import os

import pytest

from search_r1.net import free_port


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
