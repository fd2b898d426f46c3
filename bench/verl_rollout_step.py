"""verl's trainer step on CPU with verl's vLLM rollout server against the `hf` rollout replica (a
benchmark, not a test). Needs the vLLM-on-CPU environment (make install-vllm; docs/vllm_cpu.md):

    .venv-vllm/bin/python bench/verl_rollout_step.py                      # vllm (fp32, all cores) vs hf
    .venv-vllm/bin/python bench/verl_rollout_step.py --variants vllm vllm-bf16 vllm-one-core hf --steps 3

Each variant is one run of `scripts/train_grpo.sh --config-name grpo_verl_cpu_vllm` (SmolLM2-135M after
the format warm-start, 2 prompts x 4 samples, verl's FSDP2 float32 actor, our agent loop against a
BM25 retriever this script starts on the default synthetic world) with overrides:

    vllm            the config as shipped: vLLM float32, OpenMP bound to every core
    vllm-bf16       actor_rollout_ref.rollout.dtype=bfloat16
    vllm-one-core   VLLM_CPU_OMP_THREADS_BIND=auto (vLLM's default: one core of two, one reserved)
    vllm-passive    OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep instead of spinning between parallel
                    regions (the other Ray processes get the cores while vLLM's threads wait)
    vllm-avx2       vLLM float32 with oneDNN and torch limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2
                    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2), an AVX2-only CPU's GEMMs
    vllm-bf16-avx2  the same with bf16 weights (what the earlier study's AVX2 machine ran)
    hf              actor_rollout_ref.rollout.name=hf: HFGenerator in float32
    vllm-one-thread, hf-one-thread
                    the same with one torch thread per training worker and `hf` server
                    (SEARCH_R1_COMPUTE_THREADS=1; "auto" gives each cores // workers of a node)

Validation and checkpoints are off; step 1 is a warm-up and the table averages the later steps of
verl's own timers: `gen` (the rollout: agent loops, vLLM generation, retriever), `update_weights` (the
sync into the rollout), `old_log_prob`, `ref`, `update_actor`, `step`, and the generated tokens per
second of `gen` (our agent loop's generated tokens; observations excluded). Runs take 4-10 minutes each on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
ONE_THREAD = "ray_kwargs.ray_init.runtime_env.env_vars.SEARCH_R1_COMPUTE_THREADS=1"
VARIANTS = {
    "vllm": ([], {}),
    "vllm-bf16": (["actor_rollout_ref.rollout.dtype=bfloat16"], {}),
    "vllm-one-core": ([], {"VLLM_CPU_OMP_THREADS_BIND": "auto"}),
    "vllm-passive": ([], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "vllm-avx2": ([], AVX2),
    "vllm-bf16-avx2": (["actor_rollout_ref.rollout.dtype=bfloat16"], AVX2),
    "hf": (["actor_rollout_ref.rollout.name=hf"], {}),
    "vllm-one-thread": ([ONE_THREAD], {}),
    "hf-one-thread": (["actor_rollout_ref.rollout.name=hf", ONE_THREAD], {}),
}
TIMERS = ("gen", "update_weights", "old_log_prob", "ref", "update_actor", "step")
STEP_LINE = re.compile(r"step:(\d+) - (.*)$")


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        m = STEP_LINE.search(line)
        if not m:
            continue
        for item in m.group(2).split(" - "):
            key, _, value = item.partition(":")
            try:
                steps.setdefault(int(m.group(1)), {})[key.strip()] = float(
                    re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip()))
            except ValueError:
                pass
    return steps


def run_variant(name: str, retriever_url: str, steps: int, out: Path) -> dict[str, float]:
    overrides, env_extra = VARIANTS[name]
    cmd = ["bash", str(REPO / "scripts" / "train_grpo.sh"), "--config-name", "grpo_verl_cpu_vllm",
           f"search_r1.retriever.urls=[{retriever_url}]", f"trainer.total_training_steps={steps}",
           "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0",
           f"trainer.default_local_dir={out / name}", *overrides]
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), **env_extra}
    log_path = out / f"{name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - start
    log_text = log_path.read_text(errors="replace")
    if rc != 0:
        raise SystemExit(f"variant {name} failed ({rc}); log {log_path}:\n{log_text[-3000:]}")
    parsed = parse_steps(log_text)
    later = [parsed[s] for s in sorted(parsed) if s >= 2] or [parsed[max(parsed)]]
    row = {t: sum(m.get(f"timing_s/{t}", 0.0) for m in later) / len(later) for t in TIMERS}
    # generated tokens of the step's 8 trajectories (observation tokens are not generated)
    tokens = sum(m.get("response/generated_tokens_mean", 0.0) * 8 for m in later) / len(later)
    row["gen_tok_s"] = tokens / row["gen"] if row["gen"] else float("nan")
    row["log_ppl_abs_diff"] = sum(m.get("rollout_corr/log_ppl_abs_diff", 0.0) for m in later) / len(later)
    row["wall"] = wall
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["vllm", "hf"], choices=sorted(VARIANTS),
                        help="runs to make, one after the other (module docstring)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per run (step 1 is a warm-up)")
    parser.add_argument("--out", default="", help="directory for logs and run outputs (default: a temp dir)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is a warm-up)")

    from retriever_server.indexes import ensure_default_index
    from retriever_server.launcher import ServerProcess

    sys.path.insert(0, str(REPO / "bench"))
    from vllm_generation import cpu_kind

    out = Path(args.out or tempfile.mkdtemp(prefix="verl_rollout_step_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_kind()}; load average before: {os.getloadavg()[0]:.1f}; logs in {out}")
    with ServerProcess([ensure_default_index()], out / "retriever.log", flags=["--torch-threads", "1"]) as retriever:
        rows = {name: run_variant(name, retriever.url, args.steps, out) for name in args.variants}
    print(f"\nseconds per step (mean of steps 2..{args.steps}), 2 prompts x 4 samples, SmolLM2-135M warm-started")
    print(f"{'variant':>15} " + " ".join(f"{t:>14}" for t in TIMERS) + f" {'gen tok/s':>9} {'|dlogppl|':>9} {'run s':>6}")
    for name, r in rows.items():
        print(f"{name:>15} " + " ".join(f"{r[t]:>14.1f}" for t in TIMERS)
              + f" {r['gen_tok_s']:>9.1f} {r['log_ppl_abs_diff']:>9.1e} {r['wall']:>6.0f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
