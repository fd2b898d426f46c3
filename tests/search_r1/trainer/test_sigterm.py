"""A SIGTERM (a scheduler's cancel, `kill`) stops a CPU training run cleanly: the trainer's own retriever
server stops with it, and the exit code and message say what happened. Python's default would exit at
once and leave the server (and a warm-start child) running, as one stress run here did."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_sigterm_stops_the_run_and_its_retriever(synth_world, tmp_path):
    cmd = [sys.executable, "-m", "search_r1.trainer.main", "model.name=tiny-random-qwen3", "warmstart.enabled=false",
           f"data.train_files=['{synth_world / 'train.parquet'}']", f"data.test_files=['{synth_world / 'test.parquet'}']",
           "data.val_size=2", "trainer.total_steps=1000", f"trainer.output_dir={tmp_path / 'run'}",
           "trainer.threads_per_worker=1", "trainer.loggers=[jsonl]", f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    url, lines, deadline = None, [], time.monotonic() + 150
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"\[trainer\] retriever serving .* at (http://127\.0\.0\.1:\d+)/", line)
            if m:
                url = m.group(1)
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        assert url is not None, "".join(lines[-30:])
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines[-20:]) + rest
    assert "[trainer] SIGTERM: stopping the run" in rest
    with pytest.raises(httpx.TransportError):  # the run's retriever server stopped with it
        httpx.get(f"{url}/health", timeout=5)
