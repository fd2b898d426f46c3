"""Fixtures of the trainer tests: a PolicyWorker built in this process (no Ray) for fast math tests.
The Ray session they share with other rooms is `ray_session` (tests/_fixtures/ray_session.py)."""
import os

import pytest


@pytest.fixture
def local_worker_factory():
    """`workers.in_process_worker`: PolicyWorker(spec) in-process as rank 0 of 1; the rank variables it sets
    are restored afterwards."""
    from search_r1.trainer.workers import in_process_worker

    keys = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "WG_BACKEND", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "REDIS_STORE_SERVER_HOST")
    saved = {k: os.environ.get(k) for k in keys}
    yield in_process_worker
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
