"""`python -m search_r1.evaluation --base-url` against `vllm serve` on loopback (slow; .venv-vllm).

vLLM's own OpenAI-compatible server (the command docs/vllm_cpu.md gives) serves the warm-started
SmolLM2; the evaluation CLI, run as a user runs it, rolls greedy search trajectories through it
(`OpenAIGenerator`: `/v1/completions` with token-id prompts, exact output ids) and the real retriever.
The predictions are checked against the same model evaluated locally (HF transformers, float32):
greedy decoding of the same weights gives the same answers, up to near-ties that vLLM's and torch's
float32 kernels break differently.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.verl_ext.cpu.vllm.servers import NO_VLLM

pytest.importorskip("vllm", reason=NO_VLLM)

N_QUESTIONS = 8


def run_eval(args: list[str], out, timeout: float = 600) -> dict:
    cmd = [sys.executable, "-m", "search_r1.evaluation", "--out", str(out), "--limit", str(N_QUESTIONS),
           "--no-progress", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return {"results": json.loads((out / "results.json").read_text()), "predictions": predictions,
            "stdout": proc.stdout}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_cli_against_vllm_serve(warm_smollm2, vllm_serve_smollm2, synth_world, retriever_server, tmp_path):
    # the session's one `vllm serve` (conftest.py), shared with the agents' test: one start per pass
    server = vllm_serve_smollm2
    data = ["--data", str(synth_world / "test.parquet"), "--retriever-url", retriever_server.url]
    t1 = time.monotonic()
    assert httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"
    queries_before = retriever_server.health()["batching"]["batched_queries"]
    served = run_eval(["--model", "smollm2-135m-instruct", "--base-url", server.base_url,
                       "--tokenizer", warm_smollm2, *data], tmp_path / "served")
    searched = retriever_server.health()["batching"]["batched_queries"] - queries_before
    metrics = httpx.get(f"{server.base_url}/metrics").text
    t2 = time.monotonic()
    local = run_eval(["--model", warm_smollm2, "--threads", "2", *data], tmp_path / "local")
    print(f"\n[eval vs vllm serve] seconds: served eval {t2 - t1:.0f}, local eval {time.monotonic() - t2:.0f}")

    assert len(served["predictions"]) == N_QUESTIONS
    searches = sum(len(p.get("search_queries") or []) for p in served["predictions"])
    print(f"[eval vs vllm serve] {served['stdout'][-1500:]}\nsearches {searches}, retriever queries {searched}")
    # The served model searched through the real retriever, and vLLM answered every generation turn.
    assert searches > 0 and searched >= searches
    assert "vllm:request_success_total" in metrics
    # Same questions, same greedy policy: the answers agree with the local evaluation.
    assert [p["question"] for p in served["predictions"]] == [p["question"] for p in local["predictions"]]
    same = sum(a["prediction"] == b["prediction"] for a, b in zip(served["predictions"], local["predictions"]))
    assert same >= N_QUESTIONS - 1, [(a["prediction"], b["prediction"])
                                     for a, b in zip(served["predictions"], local["predictions"])]
