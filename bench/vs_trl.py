"""Our GRPO trainer against TRL's `GRPOTrainer` on identical work, in one run.

Same prompts (questions of the default synthetic world in one plain chat-template user turn, written
once and read by both), same model (SmolLM2-135M-Instruct, fp32 weights and fp32 compute, no bf16
sampling copy), same group shape (8 prompts x 4 samples, up to 128 new tokens, temperature 1,
top-p 1), no search, a KL term to a frozen reference (coefficient 0.001), one optimizer update
per batch, AdamW at lr 1e-6, the same torch thread count. Each side runs in its own process (ours in
the project venv, TRL in a separate venv that has `trl`), one after the other, while a sampler
sums the RSS of the process tree every 0.2 s. Printed per side: seconds per step (median over
the steps after the first, which warms caches), generated tokens per second of generation time,
prompt+completion tokens per second of the rest of the step (log-probs, reference, reward,
update), peak RSS of all its processes; then ours/TRL ratios and the targets: step time <= 0.85x
TRL's, peak RSS <= 8 GB.

Memory is traded differently on the two sides, each with its own default: TRL's GRPOConfig turns
gradient checkpointing on (activations recomputed in the backward pass) and updates in micro-batches
of 8 sequences; ours keeps activations and bounds them with a smaller micro-batch (`--micro-batch`,
default 4). Measured for SmolLM2 at 180 tokens per sequence, one update forward and backward held
about 0.35-0.4 GB per sequence of the micro-batch; at 8, our summed peak was 8.3 GB, at 4, 6.3 GB.
The work per step (tokens generated, scored and trained on) is the same on both sides.

Rewards: 1 if a gold answer is a substring of the completion (our `subem`; the TRL side
reimplements the same normalisation) - cheap on both sides and not timed apart.

Set up TRL once, in its own venv (torch pinned so pip takes the CPU build from disk):

    python3.11 -m venv bench/results/venv-trl
    bench/results/venv-trl/bin/pip install "torch==2.13.0" "transformers==5.10.4" trl psutil

Run (the full measurement: about 2 x (steps x ~2.5 min) on 2 cores; needs an idle machine):

    .venv/bin/python bench/vs_trl.py --steps 4 --threads 2
    .venv/bin/python bench/vs_trl.py --steps 1 --prompts 2 --group 2 --max-new-tokens 8 \\
        --model tiny-random-qwen3 --threads 1        # a smoke run (about a minute)

Where the numbers land: bench/results/vs_trl/{ours,trl}.json and a summary printed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "vs_trl"
INSTRUCTION = "Answer the question with a short phrase.\nQuestion: {question}"


# ================================================================================================
# driver (project venv)


def build_prompts(n: int, out_dir: Path) -> Path:
    """The first n questions of the default world's train split, as one plain user turn each, in the
    Search-R1 parquet schema (our PromptDataset reads it; the TRL side reads its `prompt` and golds)."""
    import pandas as pd

    from search_r1.data.synth import ensure_world
    from search_r1.paths import default_synth_dir

    world = ensure_world(default_synth_dir(), progress=False)
    frame = pd.read_parquet(Path(world) / "train.parquet").head(n).copy()
    frame["prompt"] = [[{"role": "user", "content": INSTRUCTION.format(question=q)}] for q in frame["question"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "prompts.parquet"
    frame.to_parquet(path)
    return path


def run_side(cmd: list[str], env: dict, log: Path) -> float:
    """Run one side to completion; returns its peak tree RSS in GiB. Output goes to `log`."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        from search_r1.procmem import PeakTreeMemory  # the parent's venv only: the TRL venv lacks search_r1

        rss = PeakTreeMemory(proc.pid, "rss", every=0.2)
        rc = proc.wait()
        peak = rss.stop()
    if rc != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{cmd[1:3]} failed (exit {rc}); last output of {log}:\n{tail}")
    return peak


def summarise(name: str, rec: dict) -> dict:
    steps = rec["steps"]
    later = steps[1:] or steps  # the first step warms kernels and caches
    step_s = statistics.median(s["step_s"] for s in later)
    gen_tok_s = sum(s["gen_tokens"] for s in later) / sum(s["gen_s"] for s in later)
    upd_tok_s = sum(s["update_tokens"] for s in later) / sum(s["step_s"] - s["gen_s"] for s in later)
    return {"side": name, "s/step": step_s, "gen tok/s": gen_tok_s, "update tok/s": upd_tok_s,
            "peak RSS GB": rec["peak_rss_gb"], "prompt tok": rec["prompt_tokens_mean"],
            "gen tok/step": statistics.mean(s["gen_tokens"] for s in later)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per side (default 4; the first is warm-up)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="completion cap in tokens (default 128)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF directory (default SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each side (default 2)")
    p.add_argument("--micro-batch", type=int, default=4,
                   help="our trainer's micro-batch in the update, in sequences (default 4; see the header)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of both sides (default 1e-6)")
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient to the reference (default 0.001)")
    p.add_argument("--trl-python", default=str(REPO / "bench" / "results" / "venv-trl" / "bin" / "python"),
                   help="python of the venv that has trl (default bench/results/venv-trl/bin/python)")
    p.add_argument("--only", choices=["ours", "trl"], help="run one side only (its json is still written)")
    p.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)  # internal: run one side here
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        spec = json.loads(Path(args.spec).read_text())
        (run_ours if args.side == "ours" else run_trl)(spec)
        return

    from search_r1.models import resolve_model_path

    OUT.mkdir(parents=True, exist_ok=True)
    spec = {"prompts_file": str(build_prompts(args.prompts, OUT)), "model_dir": str(resolve_model_path(args.model)),
            "model": args.model, "steps": args.steps, "prompts": args.prompts, "group": args.group,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "lr": args.lr, "beta": args.beta,
            "micro_batch": args.micro_batch,
            "out": str(OUT)}
    spec_file = OUT / "spec.json"
    spec_file.write_text(json.dumps(spec, indent=2))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_OFFLINE": "1", "WANDB_DISABLED": "true"}
    sides = [args.only] if args.only else ["ours", "trl"]
    rows = []
    for side in sides:
        python = sys.executable if side == "ours" else args.trl_python
        if not Path(python).exists():
            raise SystemExit(f"{python} does not exist. Fix: set TRL up in its own venv (see the header of "
                             f"{Path(__file__).name}) or pass --trl-python")
        print(f"[vs_trl] {side}: {args.steps} steps of {args.prompts} x {args.group}, log {OUT / (side + '.log')}",
              flush=True)
        t0 = time.perf_counter()
        peak = run_side([python, str(Path(__file__).resolve()), "--side", side, "--spec", str(spec_file)], env,
                        OUT / f"{side}.log")
        rec = json.loads((OUT / f"{side}.json").read_text())
        rec["peak_rss_gb"], rec["wall_s"] = peak, time.perf_counter() - t0
        (OUT / f"{side}.json").write_text(json.dumps(rec, indent=2))
        rows.append(summarise(side, rec))
    keys = ["side", "s/step", "gen tok/s", "update tok/s", "peak RSS GB", "prompt tok", "gen tok/step"]
    print("\n" + "  ".join(f"{k:>13}" for k in keys))
    for r in rows:
        print("  ".join(f"{r[k]:>13.2f}" if isinstance(r[k], float) else f"{r[k]:>13}" for k in keys))
    if len(rows) == 2:
        ours, trl = rows
        ratio = ours["s/step"] / trl["s/step"]
        print(f"\nours/TRL: step time {ratio:.2f}x, generation {ours['gen tok/s'] / trl['gen tok/s']:.2f}x tok/s, "
              f"update {ours['update tok/s'] / trl['update tok/s']:.2f}x tok/s")
        print(f"targets: step time <= 0.85x TRL: {'MET' if ratio <= 0.85 else 'NOT MET'} ({ratio:.2f}x); "
              f"peak RSS <= 8 GB: {'MET' if ours['peak RSS GB'] <= 8 else 'NOT MET'} ({ours['peak RSS GB']:.2f} GB)")
        if abs(ours["prompt tok"] - trl["prompt tok"]) > 0.5:
            print(f"WARNING: prompt lengths differ (ours {ours['prompt tok']:.1f}, TRL {trl['prompt tok']:.1f} tokens)")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)


# ================================================================================================
# our side (project venv)


def run_ours(spec: dict) -> None:
    from search_r1.search import MockSearchEngine
    from search_r1.trainer.config import TrainConfig
    from search_r1.trainer.main import run

    out = Path(spec["out"]) / "ours_run"
    n, t = spec["max_new_tokens"], spec["threads"]
    cfg = TrainConfig.from_dict({
        "model": {"name": spec["model_dir"], "compute_dtype": "float32", "rollout_dtype": "float32"},
        "data": {"train_files": [spec["prompts_file"]], "test_files": [spec["prompts_file"]], "val_size": 1},
        "rollout": {"n": spec["group"], "max_turns": 0, "max_tokens_per_turn": n, "max_response_length": n,
                    "temperature": 1.0, "top_p": 1.0},
        # skip_zero_advantage off: TRL steps on every batch, so ours must too for identical work
        "algorithm": {"reward": "subem", "kl_coef": spec["beta"], "entropy_coef": 0.0, "skip_zero_advantage": False},
        "optim": {"lr": spec["lr"], "warmup_steps": 0},
        "trainer": {"total_steps": spec["steps"], "batch_size": spec["prompts"], "mini_batch_size": spec["prompts"],
                    "micro_batch_size": spec["micro_batch"], "val_batch_size": 1, "test_freq": 0, "val_before_train": False,
                    "save_freq": 0, "keep_last": 1, "resume": "none", "n_workers": 1, "threads_per_worker": t,
                    "output_dir": str(out), "loggers": ["jsonl"]},
        "warmstart": {"enabled": False},
    })
    run(cfg, search_engine=MockSearchEngine({}))  # max_turns 0: the engine is never asked
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing/step" in r]
    group = spec["prompts"] * spec["group"]
    prompt_mean = _prompt_tokens_mean(spec)
    result = {"steps": [{"step_s": r["timing/step"], "gen_s": r["timing/gen"],
                         "gen_tokens": r["response/generated_tokens_mean"] * group,
                         "update_tokens": (prompt_mean + r["response/length_mean"]) * group} for r in steps],
              "prompt_tokens_mean": prompt_mean}
    (Path(spec["out"]) / "ours.json").write_text(json.dumps(result, indent=2))


def _prompt_tokens_mean(spec: dict) -> float:
    from search_r1.data.dataset import PromptDataset
    from search_r1.models import load_tokenizer

    ds = PromptDataset([spec["prompts_file"]], load_tokenizer(spec["model_dir"]), max_prompt_length=4096)
    return sum(len(r.input_ids) for r in ds.records) / len(ds)


# ================================================================================================
# TRL side (its own venv: torch, transformers, trl; nothing of ours is imported)


def _normalize(s: str) -> str:
    """Our rewards.normalize_answer: lower case, no punctuation, no articles, single spaces."""
    import re
    import string

    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def run_trl(spec: dict) -> None:
    import pandas as pd
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    frame = pd.read_parquet(spec["prompts_file"])
    golds = {p[-1]["content"]: list(rm["ground_truth"]["target"]) for p, rm in zip(frame["prompt"], frame["reward_model"])}
    data = Dataset.from_list([{"prompt": [dict(m) for m in p]} for p in frame["prompt"]])

    def subem(prompts, completions, **_):
        out = []
        for p, c in zip(prompts, completions):
            text = c[0]["content"] if isinstance(c, list) else c
            gold = golds[p[-1]["content"]]
            out.append(float(any(_normalize(g) and _normalize(g) in _normalize(text) for g in gold)))
        return out

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    batch = spec["prompts"] * spec["group"]
    micro = min(8, batch)
    args = GRPOConfig(
        output_dir=str(Path(spec["out"]) / "trl_run"), max_steps=spec["steps"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=spec["group"], max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0,
        beta=spec["beta"], num_iterations=1, loss_type="dapo", use_cpu=True, bf16=False, fp16=False,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0,
        disable_dropout=True)
    trainer = GRPOTrainer(model=model, reward_funcs=subem, args=args, train_dataset=data, processing_class=tokenizer)

    timing = {"gen_s": 0.0, "gen_tokens": 0, "prompt_tokens": 0, "completions": 0}
    original = trainer._generate_single_turn

    def timed_generate(prompt_ids, *a, **k):
        t0 = time.perf_counter()
        out = original(prompt_ids, *a, **k)
        timing["gen_s"] += time.perf_counter() - t0
        timing["gen_tokens"] += sum(len(c) for c in out[0])
        timing["prompt_tokens"] += sum(len(p) for p in prompt_ids)
        timing["completions"] += len(out[0])
        return out

    trainer._generate_single_turn = timed_generate
    steps, prompt_lengths = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            self.before = dict(timing)

        def on_step_end(self, *_, **__):
            d = {k: timing[k] - self.before[k] for k in timing}
            steps.append({"step_s": time.perf_counter() - self.t0, "gen_s": d["gen_s"], "gen_tokens": d["gen_tokens"],
                          "update_tokens": d["prompt_tokens"] + d["gen_tokens"]})
            if d["completions"]:
                prompt_lengths.append(d["prompt_tokens"] / d["completions"])

    trainer.add_callback(StepTimer())
    trainer.train()
    result = {"steps": steps, "prompt_tokens_mean": sum(prompt_lengths) / max(len(prompt_lengths), 1)}
    (Path(spec["out"]) / "trl.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
