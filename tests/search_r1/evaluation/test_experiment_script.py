"""scripts/experiment_cpu.sh end to end on a tiny model: every phase runs and writes what the results
pages read, and a finished GRPO run is reused only when its arguments are unchanged (one run shared by
three tests, each within its time budget)."""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TINY = ["model.name=tiny-random-qwen3", "warmstart.steps=1", "warmstart.n_examples=4", "trainer.n_workers=1",
        "trainer.threads_per_worker=1"]


def run_experiment(out, world, home, *overrides, **knobs):
    env = {**os.environ, "PYTHON": sys.executable, "SEARCH_R1_HOME": str(home), "EXP_OUT": str(out),
           "EXP_BACKEND": "hf", "EXP_SEEDS": "0", "EXP_STEPS": "1", "EXP_DEV_PER_SOURCE": "4",
           "EXP_DEV_VAL": "4", "EXP_TEST_PER_SOURCE": "2", "EXP_EVAL_BATCH": "4", "EXP_THREADS": "1",
           **{k: str(v) for k, v in knobs.items()}}
    env.pop("SEARCH_R1_VLLM_PYTHON", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "experiment_cpu.sh"), f"data.dir={world}", *TINY,
                           *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def python_heredocs(script: Path) -> list[str]:
    """The bodies of a shell script's `"$PYTHON" - ... <<'PY'` blocks."""
    blocks, body = [], None
    for line in script.read_text().splitlines():
        if body is None and "<<'PY'" in line:
            body = []
        elif body is not None and line == "PY":
            blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


@pytest.mark.parametrize("script", sorted((REPO / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_embedded_python_compiles_on_this_interpreter(script):
    """The inline Python of the shell scripts runs only at the end of a long experiment: a syntax error
    there (e.g. a nested f-string with the same quotes, valid only from Python 3.12) would lose the
    summary after the runs finished. Compiled here, on the project's interpreter."""
    for i, body in enumerate(python_heredocs(script)):
        compile(body, f"{script.name}:heredoc{i}", "exec")


def test_python_heredocs_finds_the_experiments_blocks():
    assert len(python_heredocs(REPO / "scripts" / "experiment_cpu.sh")) >= 4


def test_empty_seeds_with_a_test_phase_fail_before_any_work(tmp_path):
    """EXP_SEEDS set but empty used to fall back to the three default seeds; it now means "warm-starts
    only", which has nothing to compare on the test split, so with EXP_TEST=1 it stops at once."""
    env = {**os.environ, "PYTHON": sys.executable, "EXP_OUT": str(tmp_path / "out"), "EXP_SEEDS": "",
           "EXP_BACKEND": "hf", "SEARCH_R1_HOME": str(tmp_path / "home")}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "experiment_cpu.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "EXP_SEEDS is empty" in proc.stderr and "EXP_TEST=0" in proc.stderr
    assert not (tmp_path / "out").exists()


@dataclass
class Experiment:
    """The script's first run (the warm-starts and GRPO seed 0, no test phase) that the tests below
    rerun, in file order: the first with the same arguments and the test phase, the second with changed
    settings and a second seed."""
    out: Path
    world: Path
    home: Path
    log: str


@pytest.fixture(scope="module")
def experiment(synth_world, tmp_path_factory) -> Experiment:
    tmp_path = tmp_path_factory.mktemp("experiment")
    world = tmp_path / "world"  # the script builds the BM25 index inside the data directory
    shutil.copytree(synth_world, world)
    out, home = tmp_path / "out", tmp_path / "home"
    return Experiment(out, world, home, run_experiment(out, world, home, EXP_TEST=0))


@pytest.mark.slow
def test_experiment_runs_every_phase_reusing_the_identical_run(experiment):
    out = experiment.out
    run = out / "grpo_auto_seed0"
    # Same arguments: the finished run is reused, not retrained (its metrics are untouched); this run
    # adds the test phase (EXP_TEST=1, the default), which reads the reused model.
    before = (run / "metrics.jsonl").read_text()
    log = run_experiment(out, experiment.world, experiment.home)
    assert "reusing the finished run" in log
    assert (run / "metrics.jsonl").read_text() == before
    assert "rollout.backend=hf" in log
    first = experiment.log  # the run that trained: what GRPO trained on
    # The shipped recipe trains GRPO on both kinds, every two-hop question three times and every
    # single-hop one once (EXP_GRPO_SOURCES unset), never on a dev question.
    import collections
    import re

    import pyarrow.parquet as pq
    assert "GRPO prompts:" in first
    record = (run / "exp_args.txt").read_text()
    grpo_file = out / "data" / "train_grpo.parquet"
    train = pq.read_table(out / "data" / "train.parquet").to_pylist()  # the training questions minus dev
    grpo = pq.read_table(grpo_file).to_pylist()
    sources = collections.Counter(r["data_source"] for r in train)
    assert collections.Counter(r["data_source"] for r in grpo) == {"synth_hotpotqa": 3 * sources["synth_hotpotqa"],
                                                                  "synth_nq": sources["synth_nq"]}
    weight = {"synth_hotpotqa": 3, "synth_nq": 1}
    assert sorted(r["id"] for r in grpo) == sorted(r["id"] for r in train for _ in range(weight[r["data_source"]]))
    assert f"data.train_files=['{grpo_file}']" in record
    # ... with the supervised anchor at coefficient 4 on demonstrations of both kinds, half two-hop
    anchor = re.search(r"supervised anchor: (\d+) demonstrations \((\d+) two-hop\).* at coefficient 4\.0", first)
    assert anchor and int(anchor[2]) > 0, first[-3000:]
    assert "algorithm.anchor_coef=4.0" in record and "algorithm.anchor_two_hop_share=0.5" in record
    for arm in ("no-search", "rag", "warm-start", "grpo-s0"):
        results = json.loads((out / "eval" / "test" / arm / "results.json").read_text())
        per_source = results["metrics"]["per_source"]
        assert {s: m["n"] for s, m in per_source.items()} == {"synth_nq": 2, "synth_hotpotqa": 2}, arm
    comparison = (out / "comparison.md").read_text()
    assert "### Verdicts" in comparison and "two-hop EM above the baseline" in comparison
    dev_md = (out / "dev.md").read_text()
    assert "| grpo_auto_seed0 |" in dev_md
    assert "### Dev questions that changed" in dev_md  # read from each run's val_predictions.jsonl
    from search_r1.evaluation.compare import Run, changed, count_flips
    vals = Run.load_validations(out / "grpo_auto_seed0")
    flips = changed(vals[0], list(vals.values())[-1])
    for source in {a["data_source"] for _, a in flips}:  # every source with a flip has its row and counts
        up, down = count_flips(flips, source)
        assert f"| grpo_auto_seed0 | `{source}` | {up} | {down} |" in dev_md
    assert set(json.loads((out / "comparison.json").read_text())["arms"]) >= {"rag", "grpo"}
    # why two-hop answers failed: dev before and after (first and last validation), test per final model
    assert "### Two-hop dev answers by failure cause" in dev_md
    assert "| grpo_auto_seed0 step 0 | 2 |" in dev_md and "| grpo_auto_seed0 step 1 | 2 |" in dev_md
    assert "### Two-hop test answers by failure cause" in comparison
    assert "| warm-start | 2 |" in comparison and "| grpo-s0 | 2 |" in comparison
    assert (out / "comparison.png").stat().st_size > 0
    assert "trainer.seed=0" in record and "retriever.url" not in record  # the port changes every run
    assert "trainer.val_sampler=hf" in record  # dev is judged by the deterministic HF sampler by default


@pytest.mark.slow
@pytest.mark.budget(300, reason="two GRPO runs of the script (the changed seed 0 and seed 1): 153-167 s on a "
                                "2-core AVX2 EPYC (2026-12-07), too near 180 s for a slower machine")
def test_changed_settings_retrain_and_a_second_seed_gets_the_firsts_baseline(experiment):
    import pyarrow.parquet as pq

    out, world, home = experiment.out, experiment.world, experiment.home
    run = out / "grpo_auto_seed0"
    # A changed setting retrains: reusing would report a model trained under other settings.
    # EXP_GRPO_SOURCES: GRPO prompts from two-hop questions only, each twice, from the same warm-start as
    # before (its demonstrations still come from every training question, so its cache entry is reused).
    warm = [line for line in experiment.log.splitlines() if line.startswith("[experiment] warm-start search")]
    # A second seed skips the "before" validation and gives its alarms the first seed's instead: with
    # none, its only (final) validation was compared with nothing (no alarm/validation in its record).
    log = run_experiment(out, world, home, "optim.lr=2e-5", EXP_TEST=0, EXP_GRPO_SOURCES="synth_hotpotqa:2",
                         EXP_SEEDS="0 1")
    assert "reusing the finished run" not in log
    assert "optim.lr=2e-5" in (run / "exp_args.txt").read_text()
    seed1 = out / "grpo_auto_seed1"
    assert f"trainer.val_baseline={run}/metrics.jsonl" in (seed1 / "exp_args.txt").read_text()
    assert "trainer.val_baseline" not in (run / "exp_args.txt").read_text()
    seed1_vals = [r for r in map(json.loads, (seed1 / "metrics.jsonl").read_text().splitlines()) if "val/em" in r]
    assert [r["step"] for r in seed1_vals] == [1] and "alarm/validation" in seed1_vals[0]
    assert [line for line in log.splitlines() if line.startswith("[experiment] warm-start search")] == warm
    grpo_train = pq.read_table(out / "data" / "train_grpo.parquet").to_pylist()
    assert {r["data_source"] for r in grpo_train} == {"synth_hotpotqa"}
    two_hop = [r["id"] for r in pq.read_table(out / "data" / "train.parquet").to_pylist()
               if r["data_source"] == "synth_hotpotqa"]
    assert sorted(r["id"] for r in grpo_train) == sorted(two_hop * 2)  # weight 2: every question twice
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {x["question"] for x in samples} <= {r["question"] for r in grpo_train}
