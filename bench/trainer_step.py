"""Time breakdown of GRPO steps on the demo config, and the share of a step that is not model compute.

    python bench/trainer_step.py                       # configs/grpo_cpu.yaml, 2 steps, report the last
    python bench/trainer_step.py --steps 3 model.compute_dtype=float32 rollout.n=2

Runs the real trainer (Ray worker, real retriever started for the run, SmolLM2 unless overridden)
for a few steps with validation and checkpoints reduced to a minimum, then prints each step's phase
times from metrics.jsonl:

    gen           whole multi-turn rollout (driver loop + worker generation + searches)
      gen_worker  time the worker spent sampling (inside generate_sequences)
      search      retriever HTTP calls
      loop        the rest of the rollout: decoding actions, tokenizing observations, padding
    old_log_prob, ref, update_actor   worker forward / forward / forward+backward+AdamW, as seen by the
                  driver; their `*_worker` parts are the time measured inside the worker
    dispatch      Ray round trips + DataProto serialisation = driver-seen minus worker time
    reward, adv   driver-side scoring and GRPO advantages

non-model share = 1 - (gen_worker + old_log_prob_worker + ref_worker + update_actor_worker) / step,
i.e. everything outside generation, forward and backward. Target: < 20%.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("gen", "gen_worker", "search", "old_log_prob", "ref", "update_actor", "reward", "adv", "step")
WORKER = ("gen_worker", "old_log_prob_worker", "ref_worker", "update_actor_worker")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2, help="GRPO steps to run (default 2; the last is reported "
                   "in detail, all are listed)")
    p.add_argument("--config", default="grpo_cpu", help="config name under search_r1/trainer/configs/ (default grpo_cpu)")
    p.add_argument("--out", default=None, help="run directory (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the breakdown as JSON to this file")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. rollout.n=2 model.compute_dtype=float32")
    return p.parse_args(argv)


def load_config(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from search_r1.trainer.config import CONFIG_DIR, TrainConfig

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides)
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("hydra", None)
    return TrainConfig.from_dict(raw)


def breakdown(rec: dict) -> dict:
    t = {k: rec.get(f"timing/{k}", 0.0) for k in PHASES + WORKER + ("gen_model",)}
    t["loop"] = max(0.0, t["gen"] - t["gen_model"] - t["search"])
    t["dispatch"] = (t["gen_model"] - t["gen_worker"]) + sum(t[k] - t[f"{k}_worker"] for k in
                                                            ("old_log_prob", "ref", "update_actor"))
    model = sum(t[k] for k in WORKER)
    t["non_model_share"] = max(0.0, 1.0 - model / t["step"]) if t["step"] else float("nan")
    t["tokens"] = rec.get("actor/update_tokens", 0.0)
    t["response_length_mean"] = rec.get("response/length_mean", 0.0)
    return t


def main(argv=None) -> int:
    args = parse_args(argv)
    from search_r1.trainer.main import run

    out = Path(args.out or tempfile.mkdtemp(prefix="trainer_step_"))
    overrides = [f"trainer.total_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
                 "trainer.save_freq=0", "trainer.resume=none", "data.val_size=1", "trainer.val_batch_size=1",
                 "trainer.loggers=[jsonl]", f"trainer.output_dir={out}",
                 # every step measured in full: a skipped update (no reward signal) would time nothing
                 "algorithm.skip_zero_advantage=false"] + list(args.overrides)
    cfg = load_config(args.config, overrides)
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward/mean" in r]
    rows = [breakdown(r) for r in steps]
    print(f"\ntrainer step breakdown ({args.config} + {' '.join(args.overrides) or 'no overrides'}; "
          f"batch {cfg.trainer.batch_size} prompts x n={cfg.rollout.n}, {cfg.model.name}, "
          f"{cfg.model.compute_dtype}, {cfg.trainer.n_workers} worker(s) x {cfg.trainer.threads_per_worker} threads)")
    header = ["step"] + list(PHASES) + ["loop", "dispatch", "non_model_share", "resp_len"]
    print("  ".join(f"{h:>12}" for h in header))
    for r, row in zip(steps, rows):
        vals = ([r["step"]] + [row[k] for k in PHASES]
                + [row["loop"], row["dispatch"], row["non_model_share"], row["response_length_mean"]])
        print("  ".join(f"{v:>12.3f}" if isinstance(v, float) else f"{v:>12}" for v in vals))
    last = rows[-1]
    verdict = "OK" if last["non_model_share"] < 0.20 else "ABOVE TARGET"
    print(f"\nlast step: {last['step']:.1f} s, outside model compute {100 * last['non_model_share']:.1f}% "
          f"(target < 20%: {verdict}); search {last['search']:.2f} s, rollout loop {last['loop']:.2f} s, "
          f"Ray dispatch {last['dispatch']:.2f} s, "
          f"reward+adv {last['reward'] + last['adv']:.3f} s. Whole run incl. startup: {wall:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": rows, "wall_s": wall, "overrides": args.overrides}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
