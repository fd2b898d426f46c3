"""verl's own trainer end to end on this CPU (slow): `bash scripts/train_grpo.sh --config-name grpo_verl_cpu`
(verl_ext.main -> verl's run_ppo/TaskRunnerV1),
i.e. verl's RLHFDataset, AgentLoopManager/AgentLoopWorker running verl_ext's SearchR1AgentLoop against the
real retriever server, verl's reward loop with verl_ext.reward.compute_score, the search_r1_grpo
estimator, the search_r1 trainer mode, FSDP2 actor/ref workers (gloo) doing log-probs and the PPO
update with K3 KL, the naive weight sync into the `hf` rollout server, validation, a checkpoint, and a
resumed run: 1 step (validation before and after it, a checkpoint), then a second process resumes from
that checkpoint for step 2. The least work that shows KL at 0 then above it, two different batches, a
save and a resume; one run shared by three tests, each within its time budget.

The policy is tiny-random-qwen3 after the project's format warm-start, through the documented override
`actor_rollout_ref.model.path=${search_r1_warmstart:tiny-random-qwen3}` (built once with the config's
`warmstart:` settings and cached under $SEARCH_R1_HOME/warmstart): at temperature 1 it writes a mix of
well-formed searches/answers and junk, so its searches reach the retriever, the seed reward differs
inside GRPO groups (non-zero advantages) and the update has a signal. The random model itself never
writes a tag (reward constant, no search).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from search_r1.procmem import PeakTreeMemory

REPO = Path(__file__).resolve().parents[3]
STEP_LINE = re.compile(r"step:(\d+) - (.*)$")


def parse_steps(log: str) -> dict[int, dict[str, str]]:
    """verl's console logger lines `step:N - key:value - key:value ...` -> {N: {key: value}} (merged)."""
    steps: dict[int, dict[str, str]] = {}
    for line in log.splitlines():
        m = STEP_LINE.search(line)
        if m:
            fields = steps.setdefault(int(m.group(1)), {})
            for item in m.group(2).split(" - "):
                key, _, value = item.partition(":")
                fields[key.strip()] = value.strip()
    return steps


def number(text: str) -> float:
    """'np.float64(0.25)' or '0.25' -> 0.25."""
    return float(re.sub(r"^np\.\w+\((.*)\)$", r"\1", text))


def run_trainer(overrides: list[str], log_path: Path, timeout: float,
                config: str = "grpo_verl_cpu") -> tuple[int, str, float, float]:
    # The documented command; the script sets VERL_PLATFORM=cpu for *_cpu configs and runs verl_ext.main
    # with this interpreter (PYTHON).
    cmd = ["bash", str(REPO / "scripts" / "train_grpo.sh"), "--config-name", config, *overrides]
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "RAY_DEDUP_LOGS": "0", "PYTHONPATH": str(REPO)}
    env.pop("VERL_PLATFORM", None)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        # PSS: shared pages (torch, Ray's object store) counted once, not once per process
        mem = PeakTreeMemory(proc.pid, "pss", every=2.0)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
            peak = mem.stop()
    return rc, log_path.read_text(errors="replace"), time.monotonic() - start, peak


WARM_MODEL = "actor_rollout_ref.model.path=${search_r1_warmstart:tiny-random-qwen3}"


def resolved_model_path(overrides: list[str]) -> str:
    """The model directory the run's config resolves to, resolved here in the test process (the
    warm-start is built on first use and reused by the run, so its cost stays out of the run's time)."""
    from hydra import compose, initialize_config_dir

    import verl_ext
    import verl_ext.cpu  # noqa: F401  (registers the config resolvers)

    with initialize_config_dir(config_dir=str(Path(verl_ext.__file__).parent / "configs"), version_base=None):
        cfg = compose("grpo_verl_cpu", overrides=overrides)
    return str(cfg.actor_rollout_ref.model.path)


@dataclass
class TrainedRun:
    """One 1-step run of verl's trainer that the tests below read and resume."""
    common: list[str]   # the overrides of the run, for the resumed one
    ckpt: Path          # trainer.default_local_dir
    model_path: str     # the warm-started initial model
    steps: dict         # parse_steps of its console log
    latest: str         # latest_checkpointed_iteration.txt right after the run
    seconds: float


@pytest.fixture(scope="module")
def trained(synth_world, retriever_server, tmp_path_factory) -> TrainedRun:
    tmp_path = tmp_path_factory.mktemp("verl_e2e")
    ckpt = tmp_path / "ckpt"
    common = [
        f"data.train_files={synth_world / 'train.parquet'}",
        f"data.val_files={synth_world / 'test.parquet'}",
        f"search_r1.retriever.urls=[{retriever_server.url}]",
        f"trainer.default_local_dir={ckpt}",
        WARM_MODEL,
        # Groups of 4 (2 prompts x 4 samples per step): the warm model is well formed in ~40% of its
        # samples, so a group holds two different rewards with probability ~0.85.
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.save_freq=1",
    ]
    start = time.monotonic()
    model_path = resolved_model_path(common)
    warm_seconds = time.monotonic() - start
    assert "/warmstart/" in model_path, model_path
    queries_before = retriever_server.health()["batching"]["batched_queries"]
    rc, log, seconds, peak = run_trainer(common, tmp_path / "run1.log", timeout=540)
    queries = retriever_server.health()["batching"]["batched_queries"] - queries_before
    print(f"\n[verl cpu e2e] warm-start model (built or reused): {warm_seconds:.0f} s; 1 step: {seconds:.0f} s, "
          f"peak PSS {peak:.2f} GB; retriever queries during the run "
          f"(searches and the resolver's warm-start demonstrations): {queries}")
    assert rc == 0, log[-6000:]
    latest = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    return TrainedRun(common, ckpt, model_path, parse_steps(log), latest, seconds)


def check_step(m: dict[str, str]) -> None:
    """One training step's metrics: our agent loop, reward and estimator ran, searches were answered,
    and the rollout sampled from the actor's weights."""
    print("[verl cpu e2e] step: " + ", ".join(
        f"{k} {number(m[k]):.3g}" for k in ("critic/score/mean", "critic/score/min", "critic/score/max",
                                             "env/searches_mean", "env/valid_action_ratio",
                                             "env/finish_ratio", "critic/advantages/max", "actor/kl_loss")))
    # Every trajectory went through the Search-R1 agent loop (its stats reach the trainer) and the
    # reward loop (critic/score, the seed reward in [-1, 2.5]), and got a GRPO advantage.
    assert float(m["env/turns_mean"]) >= 1.0
    assert -1.0 <= number(m["critic/score/min"]) <= number(m["critic/score/mean"]) <= number(m["critic/score/max"]) <= 2.5
    # The policy searched, and the real retriever answered every search (a failed one is counted).
    assert number(m["env/searches_mean"]) > 0.0 and number(m["env/search_failures"]) == 0.0, m
    # The rollout server samples from the actor's current weights: its log-probs of the sampled
    # tokens equal the actor's float32 recomputation (mean |log-ppl difference| per sequence).
    # After an update with lr 1e-3, a missed weight sync makes this ~1e-2.
    assert number(m["rollout_corr/log_ppl_abs_diff"]) < 1e-4, m["rollout_corr/log_ppl_abs_diff"]


@pytest.mark.slow
@pytest.mark.budget(500, reason="its setup is the shared run: verl's trainer starting (~100 s of Ray actors "
                                "and imports) and one step, 150-175 s alone on a 2-core AVX2 EPYC, 333 s in make "
                                "test's two workers (2026-12-07)")
def test_one_step_searches_scores_and_syncs(trained):
    steps = trained.steps
    assert set(steps) >= {0, 1}, sorted(steps)
    # Validation before training and after the step, scored by our compute_score per data_source.
    for s in (0, 1):
        per_source = [k for k in steps[s] if re.fullmatch(r"val/synth_\w+/em", k)]
        assert per_source and "val/em" in steps[s], sorted(steps[s])
    check_step(steps[1])
    # K3 KL to the reference: exactly 0 before the first update (same fp32 weights).
    assert number(steps[1]["actor/kl_loss"]) == 0.0


@pytest.mark.slow
def test_checkpoint_holds_the_moved_policy(trained):
    # Checkpoint of step 1 (actor shards, optimizer, dataloader state).
    step_dir = trained.ckpt / "global_step_1"
    assert trained.latest == "1"
    assert (step_dir / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert (step_dir / "actor" / "optim_world_size_1_rank_0.pt").is_file()
    assert (step_dir / "data.pt").is_file()
    # The policy weights in the checkpoint moved away from the initial (warm-started) model.
    import torch

    from search_r1.models import load_model_and_tokenizer

    initial = load_model_and_tokenizer(trained.model_path)[0].state_dict()
    saved = torch.load(step_dir / "actor" / "model_world_size_1_rank_0.pt", weights_only=False, map_location="cpu")
    moved = {n: float((t.to_local() if hasattr(t, "to_local") else t).float().sub(initial[n]).abs().max())
             for n, t in saved.items() if n in initial}
    assert len(moved) == len(initial), sorted(set(initial) - set(moved))
    assert sum(d > 0 for d in moved.values()) >= 0.9 * len(moved) and max(moved.values()) > 1e-4, moved


@pytest.mark.slow
@pytest.mark.budget(500, reason="a second start of verl's trainer and one step: 114-126 s alone on a 2-core "
                                "AVX2 EPYC, 243 s in make test's two workers (2026-12-07)")
def test_resume_trains_step_two_from_the_checkpoint(trained, tmp_path):
    # A second process continues from the checkpoint: step 2 only (no step 1 again, no initial validation).
    rc, log2, seconds2, _ = run_trainer([*trained.common, "trainer.total_training_steps=2",
                                         "trainer.val_before_train=false"], tmp_path / "run2.log", timeout=360)
    print(f"[verl cpu e2e] resume + 1 step: {seconds2:.0f} s")
    assert rc == 0, log2[-6000:]
    resumed = parse_steps(log2)
    assert set(resumed) == {2}, sorted(resumed)
    check_step(resumed[2])  # the rollout server got the resumed weights (verl syncs them in on_init_end)
    # The resumed policy is the trained one: KL to the reference is above 0, where step 1 had exactly 0
    # (a run measured 0, then 0.0208).
    assert number(resumed[2]["actor/kl_loss"]) > 0.0
    assert (trained.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    steps = {1: trained.steps[1], 2: resumed[2]}
    # Rewards differ inside a batch, and inside some group, so GRPO advantages are not all 0 (each
    # fails in a given step with probability ~0.02 / ~0.02, in both ~4e-4).
    assert any(number(steps[s]["critic/score/max"]) > number(steps[s]["critic/score/min"]) for s in (1, 2))
    assert any(number(steps[s]["critic/advantages/max"]) > 0.0 > number(steps[s]["critic/advantages/min"])
               for s in (1, 2))
    # The resumed step has its own batch (the dataloader's state was restored: new prompts, new samples,
    # a moved policy), not a repeat of the first. The mean reward alone cannot show it: 8 rewards from a
    # few values gave -0.625 at three steps in a row in one run; the mean response length differs too.
    batches = {(number(steps[s]["critic/score/mean"]), number(steps[s]["response_length/mean"])) for s in (1, 2)}
    assert len(batches) > 1, batches


def test_warmstart_resolver_trains_once_with_the_config_settings(synth_world, retriever_server, tmp_path, monkeypatch):
    """`${search_r1_warmstart:NAME}` (fast settings): the SFT runs with the `warmstart:` group and the
    search_r1 limits, lands in $SEARCH_R1_HOME/warmstart, is reused; enabled=false gives NAME's own
    directory; an unknown warmstart key is an error naming it."""
    import json

    from omegaconf.errors import InterpolationResolutionError

    from search_r1.models import resolve_model_path

    base = resolve_model_path("tiny-random-qwen3")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models").symlink_to(Path(base).parent)  # the built tiny model, not a rebuild
    monkeypatch.setenv("SEARCH_R1_HOME", str(tmp_path / "home"))
    common = [f"data.train_files={synth_world / 'train.parquet'}", f"search_r1.retriever.urls=[{retriever_server.url}]",
              WARM_MODEL, "warmstart.steps=2", "warmstart.batch_size=1", "warmstart.n_examples=2", "warmstart.lr=0.001"]
    path = Path(resolved_model_path(common))
    assert path.parent == tmp_path / "home" / "warmstart", path
    meta = json.loads((path / "warmstart.json").read_text())
    assert (meta["base_model"], meta["steps"], meta["batch_size"], meta["n_demos"], meta["lr"]) == \
        ("tiny-random-qwen3", 2, 1, 2, 0.001)
    assert (meta["max_obs_length"], meta["max_tokens_per_turn"]) == (128, 64)  # grpo_verl_cpu's search_r1 group
    stamp = (path / "warmstart.json").stat().st_mtime_ns
    assert Path(resolved_model_path(common)) == path and (path / "warmstart.json").stat().st_mtime_ns == stamp
    assert resolved_model_path([*common, "warmstart.enabled=false"]) == resolve_model_path("tiny-random-qwen3")
    # the group's format reaches the SFT (it was dropped once: every verl warm-start taught `search`)
    other = Path(resolved_model_path([*common, "+warmstart.format=no_search"]))
    assert other != path and json.loads((other / "warmstart.json").read_text())["format"] == "no_search"
    with pytest.raises(InterpolationResolutionError, match=r"warmstart\.\['bogus'\]"):
        resolved_model_path([*common, "+warmstart.bogus=1"])
