"""A rollout's later rounds on the previous round's KV cache, against re-prefilling the whole context
(a benchmark, not a test).

    python bench/studies/multi_turn_kv_reuse.py --model WARMSTART_DIR --data dev.parquet --retriever-index default
    python bench/studies/multi_turn_kv_reuse.py ... --limit 32 --repeats 2 -- --max-turns 2 --max-obs-length 192

Runs `python -m search_r1.evaluation` in this process on the same questions with HFGenerator's
`reuse_kv` on and off, alternating (`--repeats` pairs, so machine load hits both alike), and prints
per run: seconds, the prefill passes' seconds and tokens (new tokens only when the cache is reused),
the decoding seconds, and whether both settings wrote the same responses. Arguments after `--` go to
`search_r1.evaluation` unchanged (defaults: the demo's validation, `--max-turns 1 --max-obs-length 192
--max-response-length 384 --batch-size 32 --dtype float32`). Run it on an idle machine and write the
CPU kind beside the figures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEFAULT_EVAL_ARGS = ["--max-turns", "1", "--max-obs-length", "192", "--max-response-length", "384",
                     "--batch-size", "32", "--dtype", "float32"]


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model to evaluate (HF dir, checkpoint or alias)")
    p.add_argument("--data", required=True, help="Search-R1 parquet file with the questions")
    p.add_argument("--retriever-index", default="default",
                   help="index directory to serve (default: the synthetic world's BM25 index)")
    p.add_argument("--limit", type=int, default=32, help="questions (default 32)")
    p.add_argument("--repeats", type=int, default=1, help="on/off pairs (default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args(own)
    args.eval_args = extra or DEFAULT_EVAL_ARGS
    return args


@contextlib.contextmanager
def generator_setting(reuse: bool, timings: dict):
    """Every HFGenerator built inside gets reuse_kv=`reuse`; its forward passes are timed into `timings`."""
    from search_r1.rollout import backends

    init, forward = backends.HFGenerator.__init__, backends.HFGenerator._forward

    def patched_init(self, *a, **k):
        init(self, *a, **{**k, "reuse_kv": reuse})

    def timed_forward(self, cache, **inputs):
        t0 = time.perf_counter()
        out = forward(self, cache, **inputs)
        kind = "prefill" if inputs["input_ids"].shape[1] > 1 else "decode"
        timings[kind + "_s"] += time.perf_counter() - t0
        if kind == "prefill":
            timings["prefill_tokens"] += int(inputs["attention_mask"][:, -inputs["input_ids"].shape[1]:].sum())
        return out

    backends.HFGenerator.__init__, backends.HFGenerator._forward = patched_init, timed_forward
    try:
        yield
    finally:
        backends.HFGenerator.__init__, backends.HFGenerator._forward = init, forward


def run_once(args, reuse: bool, out_dir: Path) -> dict:
    from search_r1.evaluation import cli as eval_cli

    timings = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0}
    argv = ["--model", args.model, "--data", args.data, "--retriever-index", args.retriever_index,
            "--limit", str(args.limit), "--threads", str(args.threads), "--out", str(out_dir),
            "--overwrite", "--no-progress", *args.eval_args]
    t0 = time.perf_counter()
    with generator_setting(reuse, timings), contextlib.redirect_stdout(sys.stderr):
        rc = eval_cli.main(argv)
    if rc:
        raise SystemExit(f"search_r1.evaluation exited with {rc}")
    timings["total_s"] = time.perf_counter() - t0
    timings["responses"] = [json.loads(line)["response"] for line in open(out_dir / "predictions.jsonl")]
    return timings


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    print(f"[multi_turn_kv_reuse] torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads; {args.limit} questions; eval args {' '.join(args.eval_args)}")
    print(f"{'run':>4} {'reuse_kv':>8} {'total s':>8} {'prefill s':>9} {'prefill tokens':>14} {'decode s':>8}")
    runs = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for reuse in (True, False):
                r = run_once(args, reuse, Path(tmp) / f"{i}_{reuse}")
                runs[reuse].append(r)
                print(f"{i:>4} {'on' if reuse else 'off':>8} {r['total_s']:>8.1f} {r['prefill_s']:>9.1f} "
                      f"{r['prefill_tokens']:>14} {r['decode_s']:>8.1f}", flush=True)
    same = all(a["responses"] == b["responses"] for a, b in zip(runs[True], runs[False]))
    on, off = (sum(r["total_s"] for r in runs[k]) for k in (True, False))
    print(f"off/on total: {off / on:.2f}x; same responses with and without the cache: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
