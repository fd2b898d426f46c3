"""Both agents (`python -m search_r1.agents.toolcall` and `.weaver`) end to end against a real `vllm serve`
(slow; .venv-vllm).

The session's `vllm serve` of the warm-started SmolLM2 (conftest `vllm_serve_smollm2`, --max-model-len
2048) answers the agents' chat requests; the real retriever serves the synthetic world. Each agent
answers a batch of three single-hop questions plus one whose text alone is longer than the server's
context window: vLLM refuses that one with its 400 ("maximum context length"), the agent records it as
the question's error, and the other three complete and are scored (batch EM over them).
"""
from __future__ import annotations

import json

import pandas as pd
import pytest

from tests.verl_ext.cpu.vllm.servers import NO_VLLM

pytest.importorskip("vllm", reason=NO_VLLM)

N_NORMAL = 3
OVERFLOW_ID = "overflow_0"


@pytest.fixture(scope="module")
def batch(synth_world, tmp_path_factory):
    """A parquet file: three single-hop test questions and one that does not fit 2048 tokens."""
    frame = pd.read_parquet(synth_world / "test.parquet")
    rows = frame[frame["data_source"] == "synth_nq"].head(N_NORMAL + 1).copy()
    long = rows.iloc[N_NORMAL:].copy()
    long["id"] = OVERFLOW_ID
    long["question"] = long["question"].iloc[0] + " Consider these details first:" + " detail" * 3000
    path = tmp_path_factory.mktemp("agents_vllm") / "batch.parquet"
    pd.concat([rows.iloc[:N_NORMAL], long]).to_parquet(path)
    return path


def run_batch(main, server, retriever_server, batch, out, flags: list[str]) -> tuple[dict, dict]:
    argv = ["--model", "smollm2-135m-instruct", "--base-url", server.base_url, "--no-api-key",
            "--retriever-url", retriever_server.url, "--data", str(batch), "--out", str(out), "--concurrency", "2",
            "--no-progress", "--request-timeout", "300", "--retries", "1", *flags]
    assert main(argv) == 0
    preds = {p["id"]: p for p in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    return preds, json.loads((out / "results.json").read_text())


def check_batch(preds: dict, results: dict) -> None:
    assert len(preds) == N_NORMAL + 1
    overflow = preds.pop(OVERFLOW_ID)
    assert overflow["error"].startswith("context overflow") and "maximum context length" in overflow["error"]
    assert overflow["em"] is None and overflow["answered"] == 0.0
    assert all(p["error"] is None and p["em"] in (0.0, 1.0) for p in preds.values()), \
        [p["error"] for p in preds.values()]
    assert results["errors"]["n"] == 1 and results["errors"]["ids"] == [OVERFLOW_ID]
    overall = results["metrics"]["overall"]
    assert overall["n"] == N_NORMAL and "em" in overall and "f1" in overall


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_both_agents_against_vllm_serve(vllm_serve_smollm2, retriever_server, batch, tmp_path, capsys):
    from search_r1.agents import toolcall, weaver

    queries_before = retriever_server.health()["batching"]["batched_queries"]
    preds, results = run_batch(toolcall.main, vllm_serve_smollm2, retriever_server, batch, tmp_path / "toolcall",
                               ["--max-steps", "3", "--max-tool-calls", "2", "--max-tokens", "512",
                                "--max-tokens-per-turn", "128"])
    print(f"\n[toolcall vs vllm serve] EM {results['metrics']['overall']['em']:.3f} over {N_NORMAL}; "
          f"turns {[p['turns'] for p in preds.values()]}")
    assert all(p["turns"] >= 1 for p in preds.values() if not p["error"])
    check_batch(preds, results)

    preds, results = run_batch(weaver.main, vllm_serve_smollm2, retriever_server, batch, tmp_path / "weaver",
                               ["--max-steps", "4", "--max-tool-calls", "3", "--max-tokens", "1200",
                                "--planner-tokens", "96", "--long-tokens", "160", "--writer-steps", "2"])
    print(f"[weaver vs vllm serve] EM {results['metrics']['overall']['em']:.3f} over {N_NORMAL}; "
          f"searches {[p['searches'] for p in preds.values()]}")
    for qid, p in preds.items():
        trace = json.loads((tmp_path / "weaver" / "runs" / qid / "trace.json").read_text())
        assert trace["phase"] == "done" and (tmp_path / "weaver" / "runs" / qid / "report.md").is_file()
    check_batch(preds, results)
    searched = retriever_server.health()["batching"]["batched_queries"] - queries_before
    print(f"[agents vs vllm serve] retriever queries {searched}\n{capsys.readouterr().out[-1500:]}")
