"""Evaluate a model on Search-R1 parquet files: EM / sub-EM / F1 per data_source.

    python -m search_r1.evaluation --model outputs/grpo_cpu --data data/test.parquet --out eval/after \\
        --retriever-url http://127.0.0.1:8000
    python -m search_r1.evaluation --model smollm2-135m-instruct --data test.parquet --out eval/rag --rag \\
        --retriever-index default --limit 300    # default: the synthetic world's BM25 index
    python -m search_r1.evaluation --model Qwen/Qwen2.5-3B-Instruct --base-url http://127.0.0.1:8001 \\
        --tokenizer /models/qwen2.5-3b --data nq_test.parquet --out eval/vllm --no-search
    python -m search_r1.evaluation --compare eval/rag/results.json eval/after/results.json

Greedy rollouts through the training rollout loop (`run_llm_loop`), scored with the training
metric functions. Writes OUT/predictions.jsonl (per question: gold, prediction, scores, search
queries, the whole trajectory), OUT/results.json and prints a markdown table. Re-running the same
command resumes: questions already in predictions.jsonl are skipped, unless the settings or what
they resolve to changed (another checkpoint behind --model, tokenizer, template, data or
retriever): then it stops, naming the change (--overwrite or another --out). The rollouts and the resume
check are in runner.py, the scores and tables in search_r1/scoring.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from retriever_server.launcher import ServerStartError
from search_r1.dtypes import DTYPE_CHOICES, resolve_dtype
from search_r1.scoring import METRICS, compare_table, markdown_table
from search_r1.evaluation.runner import (ROLLOUT_FROM_CHECKPOINT, EvalConfig, checkpoint_rollout_settings, evaluate,
                                       resolve_index_arg)
from search_r1.rollout.backends import GenerationError
from search_r1.search.base import SearchError


def _parser() -> argparse.ArgumentParser:
    d = EvalConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="python -m search_r1.evaluation",
        description="Greedy evaluation of a model (HF dir, checkpoint, alias, or an OpenAI-compatible "
                    "server) on Search-R1 parquet files, with search, without search, or with one "
                    "retrieval (RAG). Prints EM / sub-EM / F1 / format / turns / searches per data_source.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model alias (smollm2-135m-instruct, tiny-random-qwen3), an HF directory, a "
                   "checkpoint dir (checkpoints/global_step_N), a training run dir (its latest checkpoint), or "
                   "with --base-url the model name the server serves")
    p.add_argument("--data", action="append", default=[], metavar="FILE.parquet",
                   help="Search-R1 parquet file (repeat for several; e.g. from python -m search_r1.data.prepare)")
    p.add_argument("--out", help="output directory (predictions.jsonl, results.json, run_config.json)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-search", action="store_true",
                      help="baseline: direct-answer prompt, no retrieval (the paper's direct inference)")
    mode.add_argument("--rag", action="store_true",
                      help="baseline: retrieve once with the question, passages in the prompt, answer without "
                           "further search (the paper's RAG)")
    p.add_argument("--retriever-url", action="append", default=[], metavar="URL",
                   help="a running retriever (http://HOST:PORT or .../retrieve); repeat for fail-over")
    p.add_argument("--retriever-index", metavar="DIR",
                   help="an index directory (python -m retriever_server build) to serve for this run; "
                        "`default` serves the default synthetic world's BM25 index (built when missing)")
    p.add_argument("--base-url", help="OpenAI-compatible server (e.g. `vllm serve`), http://HOST:PORT[/v1]")
    p.add_argument("--tokenizer", help="tokenizer for --base-url (alias or HF dir); default: --model")
    p.add_argument("--api-key-env", default=d["api_key_env"].default,
                   help="environment variable holding the server's API key; keys never go on the command line "
                        f"(default: {d['api_key_env'].default})")
    p.add_argument("--allow-insecure-http", action="store_true",
                   help="send the API key over plain http to a non-loopback --base-url (a network you trust); "
                        "without it such a URL is refused while the key variable is set")
    p.add_argument("--name", help="run name in tables (default: the --out directory name)")
    p.add_argument("--limit", type=int, help="evaluate N questions: the first N of a seeded shuffle")
    p.add_argument("--limit-per-source", type=int, help="at most N questions per data_source (seeded)")
    p.add_argument("--seed", type=int, default=d["seed"].default, help=f"seed of the --limit sample (default: {d['seed'].default})")
    p.add_argument("--batch-size", type=int, default=d["batch_size"].default, help=f"questions per rollout batch (default: {d['batch_size'].default})")
    # Rollout limits: default None, so that unset ones can come from a checkpoint's training config.
    lim = p.add_argument_group(
        "rollout limits", "Unset limits come from the training config when --model is one of our checkpoints "
        "or training runs (they are evaluated with the limits they were trained under), else from the "
        "defaults shown (upstream Search-R1's).")

    def limit(flag: str, text: str, **kw):
        field = flag[2:].replace("-", "_")
        lim.add_argument(flag, default=None, help=f"{text} (default: {d[field].default})", **kw)

    limit("--topk", "passages per search", type=int)
    limit("--protocol", "action protocol; auto = tool_call if the prompt asks for <tool_call>, else tags",
          choices=["auto", "tags", "tool_call"])
    limit("--max-turns", "rounds in which a search is allowed (one more without search follows)", type=int)
    limit("--max-start-length", "longest data prompt in tokens; longer ones are dropped with a warning (the "
          "baselines' own prompts, RAG's with its passages, may use what their answer round leaves)", type=int)
    limit("--max-prompt-length", "longest rolling context (prompt + response)", type=int)
    limit("--max-response-length", "longest response (generated + observation tokens, all turns)", type=int)
    limit("--max-obs-length", "longest search observation (and RAG context) in tokens", type=int)
    limit("--max-tokens-per-turn", "generation cap per round (None: the response budget); --no-search and --rag "
          "answer in one round of this cap times (max-turns + 1), the search mode's total", type=int)
    p.add_argument("--dtype", default=d["dtype"].default, choices=list(DTYPE_CHOICES),
                   help="local model dtype; auto = bfloat16 only where this CPU runs it faster than float32 "
                        f"(measured once per machine, search_r1.dtypes) (default: {d['dtype'].default})")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--overwrite", action="store_true",
                   help="discard earlier predictions in --out instead of resuming (a resume is refused when the "
                        "settings, or the model, tokenizer, template, data or retriever they resolve to, changed)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--compare", nargs="+", metavar="RESULTS.json",
                   help="print earlier runs' results side by side and exit (no evaluation)")
    p.add_argument("--metrics", default="em,f1",
                   help=f"metrics of the --compare table, comma-separated from {[m for m, _ in METRICS]} (default: em,f1)")
    return p


def _compare(paths: list[str], metrics: str) -> int:
    results = []
    for path in paths:
        p = Path(path)
        if p.is_dir():
            p = p / "results.json"
        if not p.is_file():
            print(f"error: {p} does not exist (pass results.json files or eval output directories)", file=sys.stderr)
            return 2
        results.append(json.loads(p.read_text()))
    print(compare_table(results, tuple(m.strip() for m in metrics.split(",") if m.strip())))
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.compare:
            return _compare(args.compare, args.metrics)
        missing = [flag for flag, value in (("--model", args.model), ("--data", args.data), ("--out", args.out))
                   if not value]
        if missing:
            print(f"error: {', '.join(missing)} required (or --compare RESULTS.json ...)", file=sys.stderr)
            return 2
        rollout = {k: getattr(args, k) for k in ROLLOUT_FROM_CHECKPOINT}
        explicit = {k: v for k, v in rollout.items() if v is not None}
        inherited = {k: v for k, v in checkpoint_rollout_settings(args.model).items() if k not in explicit}
        if inherited and not args.base_url:
            print(f"rollout limits from the checkpoint's training config: {inherited}", file=sys.stderr)
            explicit.update(inherited)
        cfg = EvalConfig(
            model=args.model, data=tuple(args.data), out=args.out, **explicit,
            mode="no_search" if args.no_search else "rag" if args.rag else "search",
            retriever_urls=tuple(args.retriever_url), retriever_index=resolve_index_arg(args.retriever_index),
            base_url=args.base_url, tokenizer=args.tokenizer, api_key_env=args.api_key_env,
            allow_insecure_http=args.allow_insecure_http, name=args.name,
            limit=args.limit, limit_per_source=args.limit_per_source, seed=args.seed,
            batch_size=args.batch_size, threads=args.threads,
            # resolved here, so results.json and the resume check record the dtype that ran
            dtype=args.dtype if args.base_url else resolve_dtype(args.dtype, "rollout", "--dtype"),
            overwrite=args.overwrite, progress=not args.no_progress)
        results = evaluate(cfg)
    except (ValueError, FileNotFoundError, GenerationError, SearchError, ServerStartError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"\n{results['name']} ({results['mode']}, {results['n']} questions, model {results['model']})")
    print(markdown_table(results["metrics"]))
    print(f"\npredictions: {Path(cfg.out) / 'predictions.jsonl'}\nresults:     {Path(cfg.out) / 'results.json'}")
    return 0
