"""verl's own trainer end to end on this CPU (slow): `bash scripts/train_grpo.sh --config-name grpo_verl_cpu`
(verl_ext.main -> verl's run_ppo/TaskRunnerV1),
i.e. verl's RLHFDataset, AgentLoopManager/AgentLoopWorker running verl_ext's SearchR1AgentLoop against the
real retriever server, verl's reward loop with verl_ext.reward.compute_score, the search_r1_grpo
estimator, the search_r1 trainer mode, FSDP2 actor/ref workers (gloo) doing log-probs and the PPO
update with K3 KL, the naive weight sync into the `hf` rollout server, validation, a checkpoint, and a
resumed run. Tiny random Qwen3, 3 steps then 1 more after resuming.

What the random tiny model cannot show: it never writes a <search> or <answer> tag, so its reward is 0
and it issues no searches (the retriever is up and configured; the search path through verl's
AgentLoopWorker is covered by tests/verl_ext/test_agent_loop_equivalence.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

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


class PeakPSS:
    """Peak summed PSS (GB) of a process and all its descendants (driver, Ray, every worker).

    PSS splits shared pages (torch libraries, Ray's object store) among the processes mapping them,
    so the sum is the memory the run really holds; summed RSS would count them once per process."""

    def __init__(self, pid: int):
        import psutil

        self.root, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_full_info().pss for p in procs if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(2.0)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**30


def run_trainer(overrides: list[str], log_path: Path, timeout: float) -> tuple[int, str, float, float]:
    # The documented command; the script sets VERL_PLATFORM=cpu for *_cpu configs and runs verl_ext.main.
    cmd = ["bash", str(REPO / "scripts" / "train_grpo.sh"), "--config-name", "grpo_verl_cpu", *overrides]
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "RAY_DEDUP_LOGS": "0", "PYTHONPATH": str(REPO)}
    env.pop("VERL_PLATFORM", None)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        mem = PeakPSS(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
            peak = mem.stop()
    return rc, log_path.read_text(errors="replace"), time.monotonic() - start, peak


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verl_trainer_three_steps_with_search_then_resume(synth_world, retriever_server, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [
        f"data.train_files={synth_world / 'train.parquet'}",
        f"data.val_files={synth_world / 'test.parquet'}",
        f"search_r1.retriever.urls=[{retriever_server.url}]",
        f"trainer.default_local_dir={ckpt}",
    ]
    rc, log, seconds, peak = run_trainer(common, tmp_path / "run1.log", timeout=540)
    print(f"\n[verl cpu e2e] 3 steps: {seconds:.0f} s, peak PSS {peak:.2f} GB")
    assert rc == 0, log[-6000:]
    steps = parse_steps(log)
    assert set(steps) >= {0, 1, 2, 3}, sorted(steps)

    # Validation before training and at the last step, scored by our compute_score per data_source.
    for s in (0, 3):
        per_source = [k for k in steps[s] if re.fullmatch(r"val/synth_\w+/em", k)]
        assert per_source and "val/em" in steps[s], sorted(steps[s])
    for s in (1, 2, 3):
        m = steps[s]
        # Every trajectory went through the Search-R1 agent loop (its stats reach the trainer) and the
        # reward loop (critic/score), and got a GRPO advantage.
        assert float(m["env/turns_mean"]) >= 1.0
        assert 0.0 <= number(m["critic/score/mean"]) <= 1.0
        assert "critic/advantages/mean" in m
        # The rollout server samples from the actor's current weights: its log-probs of the sampled
        # tokens equal the actor's float32 recomputation (mean |log-ppl difference| per sequence).
        # After an update with lr 1e-3, a missed weight sync makes this ~1e-2.
        assert number(m["rollout_corr/log_ppl_abs_diff"]) < 1e-4, m["rollout_corr/log_ppl_abs_diff"]
    # K3 KL to the reference: exactly 0 before the first update (same fp32 weights), then the policy moves.
    kl = [number(steps[s]["actor/kl_loss"]) for s in (1, 2, 3)]
    assert kl[0] == 0.0 and kl[2] > kl[1] > 0.0, kl

    # Checkpoint of step 3 (actor shards, optimizer, dataloader state).
    step_dir = ckpt / "global_step_3"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (step_dir / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert (step_dir / "actor" / "optim_world_size_1_rank_0.pt").is_file()
    assert (step_dir / "data.pt").is_file()
    # The policy weights in the checkpoint moved away from the initial model (Adam touches every
    # parameter that got a gradient: entropy bonus and KL here, since the random model earns no reward).
    import torch

    from search_r1.models import load_model_and_tokenizer

    initial = load_model_and_tokenizer("tiny-random-qwen3")[0].state_dict()
    saved = torch.load(step_dir / "actor" / "model_world_size_1_rank_0.pt", weights_only=False, map_location="cpu")
    moved = {n: float((t.to_local() if hasattr(t, "to_local") else t).float().sub(initial[n]).abs().max())
             for n, t in saved.items() if n in initial}
    assert len(moved) == len(initial), sorted(set(initial) - set(moved))
    assert sum(d > 0 for d in moved.values()) >= 0.9 * len(moved) and max(moved.values()) > 1e-4, moved

    # Resume: a fourth step continues from the checkpoint (no step 1-3 again, no initial validation).
    rc, log2, seconds2, _ = run_trainer([*common, "trainer.total_training_steps=4", "trainer.val_before_train=false"],
                                        tmp_path / "run2.log", timeout=360)
    print(f"[verl cpu e2e] resume + 1 step: {seconds2:.0f} s")
    assert rc == 0, log2[-6000:]
    steps2 = parse_steps(log2)
    assert set(steps2) == {4}, sorted(steps2)
    # The resumed policy is the trained one: KL to the reference continues from step 3, not from 0.
    assert number(steps2[4]["actor/kl_loss"]) > 0.0
    # ...and the rollout server got the resumed weights (verl syncs them in on_init_end).
    assert number(steps2[4]["rollout_corr/log_ppl_abs_diff"]) < 1e-4
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
