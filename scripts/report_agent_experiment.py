"""Can a small model write reports with the report agent once it is taught the formats? One command:

    python scripts/report_agent_experiment.py                          # SmolLM2-135M, 20 held-out two-hop questions
    python scripts/report_agent_experiment.py --n-test 8 --steps 20    # shorter
    python scripts/report_agent_experiment.py --toolcall-model outputs/toolcall_experiment/grpo   # and the tool-call
                                                     # agent (scripts/toolcall_experiment.py's model) on the same questions
    python scripts/report_agent_experiment.py --example-to docs/agents # copy the first finished report + trace there

What it does, on the default synthetic world (generated and indexed when missing):
  1. the report warm-start (search_r1.agents.report_warmstart): the report agent's own calls while a
     teacher plays its roles on training questions, then masked SFT on them (cached);
  2. `python -m search_r1.agents.weaver` with the warm-started model, greedy, on the first --n-test
     questions of a seeded shuffle of the held-out two-hop test questions (entities no training
     question mentions), against the world's retriever;
  3. optionally `python -m search_r1.agents.toolcall` with --toolcall-model on the same questions;
  4. the table, printed and written to OUT/report_agent.md:
       finished     runs that end with an outline and at least three written sections
       sections     written sections per run (mean)
       citations    `<cite>` ids in the written sections that resolve to a memory-bank summary whose
                    document a search of the same run returned (valid / all cited)
       EM           the final answer's exact match (search_r1.scoring), next to the tool-call agent's
       s / report   wall time per question
Outputs under --out (default outputs/report_agent): data/, weaver/ (predictions.jsonl, results.json,
runs/<id>/report.md + trace.json), toolcall/, report_agent.md. Resources: 2 CPU cores, < 8 GB RAM.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TWO_HOP = "synth_hotpotqa"


def table(weaver: list[dict], toolcall: list[dict] | None, n: int) -> list[str]:
    runs = [r["metrics"] for r in weaver]
    cites, valid = sum(m["cites"] for m in runs), sum(m["valid_cites"] for m in runs)
    em = [r["em"] for r in weaver if r["em"] is not None]
    lines = ["| agent | questions | finished (outline + >= 3 sections) | sections per run | citations valid | "
             "invalid actions per run | EM | s per question |", "|---|---|---|---|---|---|---|---|",
             f"| report (weaver) | {n} | {sum(m['finished'] for m in runs)} of {len(runs)} | "
             f"{statistics.fmean(m['sections'] for m in runs):.2f} | {valid} of {cites} | "
             f"{statistics.fmean(m['invalid_actions'] for m in runs):.2f} | "
             f"{statistics.fmean(em) if em else float('nan'):.3f} | "
             f"{statistics.fmean(r['seconds'] for r in weaver):.0f} |"]
    if toolcall:
        tem = [r["em"] for r in toolcall if r.get("em") is not None]
        lines.append(f"| tool-call | {n} | - | - | - | - | {statistics.fmean(tem) if tem else float('nan'):.3f} | "
                     f"{statistics.fmean(r['seconds'] for r in toolcall):.0f} |")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct", help="base model to warm-start (alias or HF directory)")
    p.add_argument("--out", type=Path, default=Path("outputs/report_agent"),
                   help="output directory (relative: to the repository)")
    p.add_argument("--n-test", type=int, default=20, help="held-out two-hop test questions (default 20)")
    p.add_argument("--questions", type=int, default=48, help="training questions the teacher's runs are kept from")
    p.add_argument("--two-hop-share", type=float, default=0.75, help="share of two-hop teacher questions")
    p.add_argument("--steps", type=int, default=60, help="SFT optimizer steps (default 60)")
    p.add_argument("--batch-size", type=int, default=8, help="demonstration calls per SFT step (default 8)")
    p.add_argument("--lr", type=float, default=1e-4, help="SFT learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the teacher's questions, the SFT and the test sample")
    p.add_argument("--date", default="2026-01-01", help="the date the agents' prompts state (reproducible prompts)")
    p.add_argument("--toolcall-model", help="also run the tool-call agent with this model on the same questions")
    p.add_argument("--example-to", type=Path, help="copy the first finished run's report.md and trace.json here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import pandas as pd

    from retriever_server.indexes import ensure_default_index
    from search_r1.agents.report_metrics import run_metrics
    from search_r1.agents.report_warmstart import ensure_report_warmstart
    from search_r1.agents.tools import AccessTool, SearchTool
    from search_r1.dtypes import machine_description
    from search_r1.evaluation.runner import open_retriever
    from search_r1.paths import default_synth_dir

    t0 = time.perf_counter()
    world = default_synth_dir()
    subprocess.run([sys.executable, "-m", "search_r1.data.synth", "--out", str(world), "--seed", "0", "--if-stale"],
                   check=True)
    index = ensure_default_index()
    out = args.out if args.out.is_absolute() else REPO / args.out
    (out / "data").mkdir(parents=True, exist_ok=True)
    test = pd.read_parquet(world / "test.parquet")
    test = test[test["data_source"] == TWO_HOP].sample(frac=1.0, random_state=args.seed).head(args.n_test)
    data = out / "data" / "test_two_hop.parquet"
    test.to_parquet(data, index=False)

    with contextlib.ExitStack() as stack:
        client = open_retriever([], str(index), 3, stack, out / "retriever.log")
        search, access = SearchTool(client), AccessTool(retriever=client)
        model_dir, meta = ensure_report_warmstart(args.model, search, access, [world / "train.parquet"],
                                                  n_questions=args.questions, steps=args.steps,
                                                  batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                                                  two_hop_share=args.two_hop_share)
        url = client.endpoints[0].url
        common = ["--retriever-url", url, "--data", str(data), "--date", args.date, "--seed", str(args.seed),
                  "--no-progress", "--overwrite"]
        subprocess.run([sys.executable, "-m", "search_r1.agents.weaver", "--model", str(model_dir),
                        "--out", str(out / "weaver"), *common], check=True)
        toolcall = None
        if args.toolcall_model:
            # the tool-call agent as scripts/toolcall_experiment.py evaluates it
            subprocess.run([sys.executable, "-m", "search_r1.agents.toolcall", "--model", args.toolcall_model,
                            "--out", str(out / "toolcall"), "--transcript", "inline", "--max-tokens-per-turn", "128",
                            "--max-tool-calls", "5", *common], check=True)
            toolcall = [json.loads(x) for x in (out / "toolcall" / "predictions.jsonl").read_text().splitlines() if x]

    weaver = []
    for rec in (json.loads(x) for x in (out / "weaver" / "predictions.jsonl").read_text().splitlines() if x):
        run_dir = Path(rec["report_path"]).parent
        rec["metrics"] = run_metrics(json.loads((run_dir / "trace.json").read_text()))
        rec["run_dir"] = str(run_dir)
        weaver.append(rec)
    lines = ["# Report agent after the report warm-start", "",
             f"Command: `python scripts/report_agent_experiment.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"Machine: {machine_description()}; float32; {time.strftime('%Y-%m-%d')}; "
             f"{time.perf_counter() - t0:.0f} s in all.",
             f"Warm-start: {model_dir} ({meta['n_demos']} calls, {meta['demos']}, loss {meta['loss_first']:.3f} -> "
             f"{meta['loss_last']:.3f}, {meta['seconds']} s).", "", *table(weaver, toolcall, len(test))]
    (out / "report_agent.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.example_to is not None:
        finished = [r for r in weaver if r["metrics"]["finished"]]
        if finished:
            args.example_to.mkdir(parents=True, exist_ok=True)
            for name in ("report.md", "trace.json"):
                shutil.copy(Path(finished[0]["run_dir"]) / name, args.example_to / name)
            print(f"[report agent] example: {args.example_to} (question {finished[0]['question']!r})")
        else:
            print("[report agent] no run finished; no example copied", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
