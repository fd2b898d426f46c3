"""Did training change these answers, or would any change of that size have changed them?

    python bench/studies/drift_null.py --base WARMSTART_DIR --trained RUN_OR_CHECKPOINT [MORE ...] \
        --out OUT_DIR [--shuffles 3] -- EVAL_ARGS...

EVAL_ARGS go to `python -m search_r1.evaluation` unchanged (data, retriever, lengths, dtype: the settings the
trainer validated with, e.g. `--data dev.parquet --retriever-index default --max-turns 1
--max-obs-length 192 --max-response-length 384 --dtype float32`).

1. Size: for every trained model, its weight change from the base, delta = trained - base: the L2 norm
   over all weights and the RMS per weight. (AdamW moves each weight by about lr per step; after T
   steps whose per-weight directions do not persist the RMS is about lr * sqrt(T), and lr * T when
   they all agree.)
2. Null: the first trained model's delta, shuffled within each tensor (the same values, so the same
   per-tensor sizes, at random positions), added to the base, once per shuffle seed. The base, the
   first trained model and every shuffled model are evaluated greedily on the same questions; printed:
   EM and the questions whose EM differs from the base. Shuffled deltas that flip nothing, next to a
   trained delta that flips answers, mean the flips are what training learned, not the size of the
   move.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def load_weights(model_dir: Path) -> dict[str, dict]:
    """{safetensors file name: {tensor name: tensor}} of an HF model directory (one file or shards)."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model_dir} has no *.safetensors file: pass an HF model directory, a "
                         f"checkpoint (checkpoints/global_step_N) or a training run directory")
    return {f.name: load_file(f) for f in files}


def displacement(base: dict[str, dict], trained: dict[str, dict]) -> tuple[float, float]:
    """(L2 norm of trained - base over all weights, RMS per weight), computed in float32."""
    squares, count = 0.0, 0
    for fname, tensors in base.items():
        for name, b in tensors.items():
            if name not in trained.get(fname, {}):
                raise SystemExit(f"{name} is in the base model but not in the trained one: the two are "
                                 f"not the same architecture")
            squares += ((trained[fname][name].float() - b.float()) ** 2).sum().item()
            count += b.numel()
    return squares ** 0.5, (squares / count) ** 0.5


def shuffled_model(base_dir: Path, base: dict, trained: dict, seed: int, out: Path) -> Path:
    """Write base + (trained - base) shuffled within each tensor to `out` (an HF directory)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in base_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(seed)
    for fname, tensors in base.items():
        new = {}
        for name, b in tensors.items():
            delta = (trained[fname][name].float() - b.float()).flatten()
            delta = delta[torch.randperm(delta.numel(), generator=gen)].view_as(b)
            new[name] = (b.float() + delta).to(b.dtype).contiguous()
        save_file(new, out / fname, metadata={"format": "pt"})
    return out


def evaluate(model: Path, out: Path, eval_args: list[str]) -> "Run":
    from search_r1.evaluation.compare import Run

    cmd = [sys.executable, "-m", "search_r1.evaluation", "--model", str(model), "--out", str(out),
           "--overwrite", "--no-progress", *eval_args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"evaluation of {model} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return Run.load(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, eval_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Arguments after -- go to python -m search_r1.evaluation.")
    parser.add_argument("--base", required=True, help="the model training started from (HF directory)")
    parser.add_argument("--trained", required=True, nargs="+",
                        help="trained models (HF directory, checkpoint or run directory); the first is "
                             "evaluated and its change shuffled")
    parser.add_argument("--out", required=True, help="directory for the shuffled models and evaluations")
    parser.add_argument("--shuffles", type=int, default=3, help="shuffled models (seeds 0..N-1); 0 = sizes only")
    args = parser.parse_args(own)
    if args.shuffles and not eval_args:
        parser.error("give the evaluation's arguments after -- (at least --data and a retriever), or --shuffles 0")

    from search_r1.evaluation.compare import changed, count_flips, run_stats
    from search_r1.evaluation.runner import resolve_model_dir

    base_dir = Path(resolve_model_dir(args.base))
    trained_dirs = [Path(resolve_model_dir(t)) for t in args.trained]
    base = load_weights(base_dir)
    first = None
    for path in trained_dirs:
        weights = load_weights(path)
        first = first or weights
        norm, rms = displacement(base, weights)
        print(f"[size] {path}: |delta| {norm:.4f}, RMS per weight {rms:.3e}")
    if not args.shuffles:
        return 0

    out = Path(args.out)
    models = {"base": base_dir, "trained": trained_dirs[0]}
    for seed in range(args.shuffles):
        models[f"shuffled{seed}"] = shuffled_model(base_dir, base, first, seed, out / f"shuffled{seed}_model")
    runs = {}
    for name, model in models.items():
        runs[name] = evaluate(model, out / f"eval_{name}", eval_args)
        stats = run_stats(runs[name], None)
        flips = [] if name == "base" else changed(runs["base"], runs[name])
        gained, lost = count_flips(flips)
        print(f"[eval] {name:<10} EM {stats['em']:.3f} on {stats['n']} questions; against the base "
              f"{gained} wrong -> right, {lost} right -> wrong")
        for b, a in flips:
            print(f"[eval]   {'+' if a['em'] > b['em'] else '-'} {a['question']!r}: {b['prediction']!r} -> {a['prediction']!r}")
    for seed in range(args.shuffles):  # 0.5 GB each for a 135M model in float32
        shutil.rmtree(out / f"shuffled{seed}_model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
