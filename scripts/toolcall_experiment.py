"""Is the tool-call format worth training for? One command:

    python scripts/toolcall_experiment.py                       # SmolLM2-135M, 6 GRPO steps, 60 test questions
    python scripts/toolcall_experiment.py --steps 4 --n-test 20 -- optim.lr=2e-5   # Hydra overrides after --
    python scripts/toolcall_experiment.py --model tiny-random-qwen3 --steps 1 --n-test 4 -- warmstart.steps=1 \\
        warmstart.n_examples=4                                  # a smoke run (minutes)

What it does, on the default synthetic world (generated and indexed when missing):
  1. data: the world's single-hop (synth_nq) questions with the tool-call agent's own prompt
     (`search_r1.agents.prompts.toolcall_messages`: system message with the date and the search
     budget, the QwQ tool-call syntax; user message "Question: ..."): train split for training, the
     held-out test split (questions about entities no training question mentions) for evaluation;
  2. training with the embedded trainer (`python -m search_r1.trainer.main`, configs/grpo_cpu.yaml):
     data.protocol=tool_call, the supervised format warm-start (demonstrations in the JSON form the
     prompt shows) and then GRPO for --steps steps (2 prompts x 4 samples, seed reward);
  3. evaluation: `python -m search_r1.agents.toolcall` on the first --n-test test questions of a
     seeded shuffle, greedy, inline transcript (how the rollout lays out tool responses), same
     prompt date and budgets, with the untrained model, the warm-started model and the GRPO model;
  4. the comparison table (EM, F1, format, per source and overall) with n, CPU kind and dtypes,
     printed and written to OUT/comparison.md.

Outputs under --out (default outputs/toolcall_experiment): data/, grpo/ (the run: metrics,
checkpoints), eval/{untrained,warmstart,grpo}/ (predictions.jsonl, results.json), retriever.log,
comparison.md. Resources: 2 CPU cores, < 8 GB RAM, no GPU, no network.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Training settings for tool-call turns (longer than tag turns) and the agent's longer prompt; the
# command line's Hydra overrides come after these and win.
TRAIN_OVERRIDES = [
    "data.protocol=tool_call", "data.max_prompt_length=512", "data.val_size=8",
    "rollout.max_start_length=512", "rollout.max_prompt_length=1024", "rollout.max_response_length=384",
    "rollout.max_obs_length=192", "rollout.max_tokens_per_turn=96",
    # micro-batch 1: 1024-token contexts; the first run here, at 2, was killed by Ray's memory monitor
    # on a machine shared with other jobs
    "trainer.batch_size=2", "trainer.mini_batch_size=2", "trainer.micro_batch_size=1", "optim.lr=3e-5",
    "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.keep_last=1",
    "trainer.resume=none", "trainer.loggers=[console,jsonl]",
]


def cpu_kind() -> str:
    name = "unknown CPU"
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "unknown CPU":
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return f"{os.cpu_count()}-core {name} ({isa or platform.machine()})"


def write_data(world: Path, out: Path, budget: int, date: str) -> tuple[Path, Path]:
    """Single-hop train and test parquet files whose prompt is the tool-call agent's."""
    import pandas as pd

    from search_r1.agents.prompts import toolcall_messages

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split in ("train", "test"):
        frame = pd.read_parquet(world / f"{split}.parquet")
        frame = frame[frame["data_source"] == "synth_nq"].reset_index(drop=True)
        frame["prompt"] = [toolcall_messages(q, budget=budget, date=date) for q in frame["question"]]
        path = out / f"{split}_toolcall.parquet"
        frame.to_parquet(path, index=False)
        paths.append(path)
        print(f"[experiment] {path}: {len(frame)} {split} questions", flush=True)
    return paths[0], paths[1]


def run(cmd: list[str], **kw) -> None:
    print("[experiment] $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, **kw)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct", help="base model (default: smollm2-135m-instruct)")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps after the warm-start (default: 6)")
    p.add_argument("--n-test", type=int, default=60, help="held-out test questions evaluated (default: 60)")
    p.add_argument("--budget", type=int, default=5, help="the agent's search budget, stated in the prompt (default: 5)")
    p.add_argument("--date", default="2026-11-23", help="the date every prompt states (default: 2026-11-23)")
    p.add_argument("--out", default="outputs/toolcall_experiment", help="output directory")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the evaluations (default: 2)")
    p.add_argument("--skip-train", action="store_true", help="reuse OUT/grpo from an earlier run")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of configs/grpo_cpu.yaml (after --)")
    args = p.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    os.environ.update(env)
    out = (REPO / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}

    from retriever_server.indexes import ensure_default_index
    from retriever_server.launcher import ServerProcess
    from search_r1.paths import default_synth_dir

    index = ensure_default_index()  # the default world (seed 0) and its BM25 index, built when missing
    train, test = write_data(default_synth_dir(), out / "data", args.budget, args.date)
    server = ServerProcess([index], out / "retriever.log", flags=["--torch-threads", "1", "--faiss-threads", "1"])
    server.start()
    try:
        grpo = out / "grpo"
        if not args.skip_train:
            t = time.perf_counter()
            run([sys.executable, "-m", "search_r1.trainer.main", f"model.name={args.model}",
                 f"data.train_files=['{train}']", f"data.test_files=['{test}']", f"retriever.url={server.url}",
                 f"trainer.total_steps={args.steps}", f"trainer.output_dir={grpo}",
                 "trainer.experiment_name=toolcall_experiment", *TRAIN_OVERRIDES, *args.overrides], env=env)
            timings["train_minutes"] = round((time.perf_counter() - t) / 60, 1)
        from search_r1.evaluation.runner import resolve_model_dir

        trained = resolve_model_dir(str(grpo))
        state = json.loads((Path(trained).parent / "trainer_state.json").read_text())
        warm = state["extra_state"]["reference"]["path"]  # the KL reference is the warm-started model
        models = {"untrained": args.model, "warmstart": warm, "grpo": trained}
        results = []
        for name, model in models.items():
            t = time.perf_counter()
            run([sys.executable, "-m", "search_r1.agents.toolcall", "--model", model, "--retriever-url", server.url,
                 "--data", str(test), "--limit", str(args.n_test), "--out", str(out / "eval" / name), "--name", name,
                 "--date", args.date, "--max-tool-calls", str(args.budget), "--max-tokens-per-turn", "128",
                 "--transcript", "inline", "--threads", str(args.threads), "--dtype", "float32", "--no-progress"],
                env=env)
            timings[f"eval_{name}_minutes"] = round((time.perf_counter() - t) / 60, 1)
            results.append(json.loads((out / "eval" / name / "results.json").read_text()))
    finally:
        server.stop()

    from search_r1.scoring import compare_table

    table = compare_table(results, ("em", "f1", "format_valid"))
    cfg = json.loads((Path(trained).parent / "trainer_state.json").read_text())["extra_state"]["config"]
    lines = [
        f"# Tool-call agent: untrained vs trained ({datetime.date.today().isoformat()})", "",
        f"Base model {args.model}; warm-start {cfg['warmstart']['steps']} SFT steps, then GRPO "
        f"{cfg['trainer']['total_steps']} steps ({cfg['trainer']['batch_size']} prompts x {cfg['rollout']['n']}, "
        f"lr {cfg['optim']['lr']}); training compute {cfg['model']['compute_dtype']}, rollout "
        f"{cfg['model']['rollout_dtype']}; evaluation float32, greedy, budget {args.budget} searches, "
        f"inline transcript. {results[0]['n']} held-out single-hop test questions. CPU: {cpu_kind()}.", "",
        table, "",
        "Mean searches per question: " + ", ".join(
            f"{r['name']} {r['metrics']['overall'].get('searches', float('nan')):.2f}" for r in results), "",
        f"Timings of this invocation (minutes; evaluations resumed from earlier predictions take ~0): "
        f"{json.dumps(timings)}; total {round((time.perf_counter() - started) / 60, 1)}.", "",
        f"Command: python scripts/toolcall_experiment.py --steps {args.steps} --n-test {args.n_test}"
        + (" -- " + " ".join(args.overrides) if args.overrides else ""),
    ]
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
