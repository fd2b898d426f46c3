"""The command line shared by both agents: flags, the model and tools they build, and the two run
modes: one question (`--question`, with a live trace of actions on the console) or a batch
(`--data FILE.parquet --out DIR`, scored like `python -m search_r1.evaluation`: EM / sub-EM / F1 per
data_source, predictions.jsonl, results.json, resume; several questions in flight with
`--concurrency`, a progress bar).

A question whose run fails (the server's 401/403 or another 4xx, the server down after the
retries, a conversation the context window cannot hold even after the agent's recovery) is recorded
in predictions.jsonl with its `error` and no scores; the batch goes on. The summary counts the errors
and scores the other questions only. Running the batch again (resume) retries the errored questions
(the report agent from its saved step) and keeps the rest.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from search_r1.agents.budget import Budgets

AGENTS = ("toolcall", "weaver")
DEFAULT_BUDGETS = {"toolcall": Budgets(max_steps=8, max_tool_calls=5, max_tokens=4096, max_seconds=300.0),
                   "weaver": Budgets(max_steps=12, max_tool_calls=10, max_tokens=16384, max_seconds=900.0)}
DESCRIPTIONS = {
    "toolcall": "Tool-call agentic RAG (QwQ style): the model calls web_search (and access) through "
                "<tool_call> JSON, reads <tool_response>, and answers with cited sources.",
    "weaver": "Planner/writer report agent with a memory bank: the planner searches, reads pages "
              "(summarised per goal into a memory bank) and outlines; the writer writes each section "
              "from the summaries it cites; then a short answer. Writes report.md and trace.json.",
}


@dataclass(frozen=True)
class BatchConfig:
    """What `evaluation.runner.prepare_out_dir` needs: the output dir and the settings a resumed
    run must share with the predictions already there."""

    out: str
    overwrite: bool
    settings: dict

    def resume_view(self) -> dict:
        return dict(self.settings)


def build_parser(agent: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """The flags of `python -m search_r1.agents.<agent>`; `epilog`: the agent module's docstring."""
    b = DEFAULT_BUDGETS[agent]
    p = argparse.ArgumentParser(prog=f"python -m search_r1.agents.{agent}", description=DESCRIPTIONS[agent],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True,
                   help="local: an alias (smollm2-135m-instruct), an HF directory, one of our checkpoints "
                        "(checkpoints/global_step_N) or training runs; with --base-url: the served model's name")
    g.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8001/v1 (vllm serve) "
                                      "or https://api.openai.com/v1; omit to run --model locally")
    g.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the server's API key (keys never go on the command line "
                        "and are never logged; plain http is refused for a key except to loopback) "
                        "(default: OPENAI_API_KEY)")
    g.add_argument("--no-api-key", action="store_true",
                   help="send no API key, whatever the environment holds (a server that needs none, e.g. a "
                        "remote `vllm serve` without --api-key, over plain http)")
    g.add_argument("--allow-insecure-http", action="store_true",
                   help="send the API key over plain http to a non-loopback --base-url (only on a network you trust)")
    g.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds per model request before it counts as failed (default: 300)")
    g.add_argument("--retries", type=int, default=3,
                   help="extra attempts of a model request after a connection error, timeout, 408/429 or 5xx, with "
                        "backoff; then the question ends with an error (default: 3)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="local model dtype (default: float32; bfloat16 only pays on CPUs with native bf16)")
    g.add_argument("--threads", type=int, help="torch threads for a local model (default: torch's choice)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed, and the seed of the --limit sample (default: 0)")
    g.add_argument("--date", help="the date the prompt states as today (default: today), for reproducible prompts")
    g = p.add_argument_group("search and access")
    g.add_argument("--retriever-url", action="append", default=[], metavar="URL",
                   help="a running retriever (python -m retriever_server serve), http://HOST:PORT; repeat for "
                        "fail-over. Its /access endpoint serves documents by id")
    g.add_argument("--retriever-index", metavar="DIR",
                   help="an index directory to serve for this run on a free loopback port; 'default' = the "
                        "synthetic world's BM25 index (generated and built when missing)")
    g.add_argument("--web-search", choices=["google", "serper", "tavily"],
                   help="search the web instead (key from GOOGLE_API_KEY + GOOGLE_CSE_ID / SERPER_API_KEY / "
                        "TAVILY_API_KEY)")
    g.add_argument("--topk", type=int, default=3, help="results per search (default: 3)")
    g.add_argument("--web-rate-limit", type=float, default=5.0,
                   help="web search requests per second over all questions in flight (default: 5)")
    g.add_argument("--web-access", choices=["auto", "on", "off"], default="auto",
                   help="let access open web pages by URL (auto: on with --web-search, off with a retriever) "
                        "(default: auto)")
    g.add_argument("--allow-private-urls", action="store_true",
                   help="let access open loopback / private / link-local addresses (refused by default: a "
                        "model must not reach local services or cloud metadata)")
    g.add_argument("--allow-network", action="append", default=[], metavar="CIDR",
                   help="a network access may open despite the guard, e.g. 10.1.0.0/16 (repeat for several)")
    g.add_argument("--page-timeout", type=float, default=10.0, help="seconds per network operation of a page "
                                                                     "fetch; 3x for the whole fetch (default: 10)")
    g.add_argument("--page-max-bytes", type=int, default=2_000_000,
                   help="bytes of a page read at most (default: 2000000)")
    g.add_argument("--doc-chars", type=int, default=20_000,
                   help="characters of an accessed document kept (default: 20000)")
    g = p.add_argument_group("budgets (each hit is recorded in the trace)")
    steps = "model turns" if agent == "toolcall" else "planner actions"
    g.add_argument("--max-steps", type=int, default=b.max_steps, help=f"{steps} (default: {b.max_steps})")
    g.add_argument("--max-tool-calls", type=int, default=b.max_tool_calls,
                   help=("searches and reads; the search budget the prompt states" if agent == "toolcall" else
                         "searches and reads") + f" (default: {b.max_tool_calls})")
    g.add_argument("--max-tokens", type=int, default=b.max_tokens,
                   help=f"generated tokens over the whole question (default: {b.max_tokens})")
    g.add_argument("--max-seconds", type=float, default=b.max_seconds,
                   help=f"wall time per question (default: {b.max_seconds:g})")
    g = p.add_argument_group(f"{agent} agent")
    if agent == "toolcall":
        g.add_argument("--max-tokens-per-turn", type=int, default=512, help="tokens per model turn (default: 512)")
        g.add_argument("--transcript", choices=["auto", "inline", "messages"], default="auto",
                       help="how tool responses reach the model: inline = inside one continued assistant message "
                            "(how our tool_call checkpoints are trained), messages = as user messages (any chat "
                            "API); auto = inline for local models, messages for servers (default: auto)")
        g.add_argument("--tools", choices=["search", "search,access"], default="search",
                       help="tools offered in the prompt (default: search)")
    else:
        g.add_argument("--planner-tokens", type=int, default=256, help="tokens per planner turn (default: 256)")
        g.add_argument("--long-tokens", type=int, default=768,
                       help="tokens per summary, outline, section and answer (default: 768)")
        g.add_argument("--writer-steps", type=int, default=4, help="writer turns per section (default: 4)")
        g.add_argument("--page-chars", type=int, default=6000,
                       help="characters of a document the summarizer reads (default: 6000)")
    g = p.add_argument_group("what to run")
    g.add_argument("--question", help="answer one question, with a live trace of the agent's actions")
    g.add_argument("--data", action="append", default=[], metavar="FILE.parquet",
                   help="Search-R1 parquet file(s) to answer and score (repeat for several)")
    g.add_argument("--out", help="output directory: predictions.jsonl, results.json (batch); " +
                   ("result.json (one question; optional)" if agent == "toolcall" else
                    "report.md and trace.json (one question; required), runs/<id>/ per question (batch)"))
    g.add_argument("--limit", type=int, help="answer N questions: the first N of a seeded shuffle")
    g.add_argument("--limit-per-source", type=int, help="at most N questions per data_source (seeded)")
    g.add_argument("--concurrency", type=int, default=1,
                   help="questions in flight at once (servers; a local model runs one call at a time) (default: 1)")
    g.add_argument("--overwrite", action="store_true", help="discard earlier results in --out instead of resuming")
    g.add_argument("--name", help="run name in the results table (default: the --out directory name)")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g.add_argument("--quiet", action="store_true", help="no live trace for a single question")
    return p


# -- building the model and the tools ------------------------------------------------------------
def open_tools(args, stack: contextlib.ExitStack, log_dir: Path):
    """(SearchTool, AccessTool) from the search / access flags; resources closed by `stack`."""
    from search_r1.agents.tools import AccessTool, SearchTool
    from search_r1.agents.urlguard import UrlGuard
    from search_r1.agents.webpage import PageFetcher
    from search_r1.evaluation.runner import open_retriever, resolve_index_arg

    chosen = [f for f, v in (("--retriever-url", args.retriever_url), ("--retriever-index", args.retriever_index),
                             ("--web-search", args.web_search)) if v]
    if len(chosen) != 1:
        raise ValueError("pass exactly one of --retriever-url, --retriever-index, --web-search "
                         f"(got {chosen or 'none'}); "
                         "e.g. --retriever-index default serves the synthetic world")
    retriever = None
    if args.web_search:
        from search_r1.search import WebSearchEngine

        engine = WebSearchEngine(provider=args.web_search, topk=args.topk, rate_limit=args.web_rate_limit)
        stack.callback(engine.close)
    else:
        index = resolve_index_arg(args.retriever_index)
        engine = retriever = open_retriever(args.retriever_url, index, args.topk, stack, log_dir / "retriever.log")
    web = args.web_access == "on" or (args.web_access == "auto" and bool(args.web_search))
    fetcher = None
    if web:
        guard = UrlGuard(allow_private=args.allow_private_urls, allowed_networks=tuple(args.allow_network))
        fetcher = PageFetcher(guard, timeout=args.page_timeout, deadline=3 * args.page_timeout,
                              max_bytes=args.page_max_bytes)
        stack.callback(fetcher.close)
    return SearchTool(engine), AccessTool(retriever=retriever, fetcher=fetcher, max_chars=args.doc_chars)


def budgets_of(args) -> Budgets:
    return Budgets(max_steps=args.max_steps, max_tool_calls=args.max_tool_calls, max_tokens=args.max_tokens,
                   max_seconds=args.max_seconds)


def settings(agent: str, args) -> dict:
    """The flags that change what an answer is (a resumed batch must match them)."""
    skip = {"question", "out", "limit", "limit_per_source", "concurrency", "overwrite", "name", "no_progress",
            "quiet", "threads", "api_key_env", "retriever_url", "retriever_index", "page_timeout", "no_api_key",
            "allow_insecure_http", "request_timeout", "retries", "web_rate_limit"}
    return {"agent": agent, **{k: v for k, v in sorted(vars(args).items()) if k not in skip}}


# -- running -------------------------------------------------------------------------------------
def run_cli(agent: str, make_agent, argv=None, epilog: str | None = None) -> int:
    """Parse `argv` and run one question or a batch; 0 on success, 2 on a user error (one line on stderr).

    `make_agent(args, model, search, access, budgets)` builds the agent from the parsed flags; each
    agent module passes its own (`toolcall.agent_from_flags`, `weaver.agent_from_flags`), so this
    module imports no agent."""
    from retriever_server.launcher import ServerStartError
    from search_r1.rollout.backends import GenerationError
    from search_r1.search.base import SearchError

    args = build_parser(agent, epilog).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if bool(args.question) == bool(args.data):
            raise ValueError("pass --question TEXT (one question) or --data FILE.parquet --out DIR (a batch)")
        if args.data and not args.out:
            raise ValueError("--data needs --out DIR (predictions.jsonl and results.json go there)")
        if agent == "weaver" and args.question and not args.out:
            raise ValueError("--out DIR is needed: report.md and trace.json go there")
        if args.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
        if args.retries < 0 or args.request_timeout <= 0 or args.web_rate_limit <= 0:
            raise ValueError(f"--retries must be >= 0 (got {args.retries}), --request-timeout and --web-rate-limit "
                             f"> 0 (got {args.request_timeout:g}, {args.web_rate_limit:g})")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        return _single(agent, make_agent, args) if args.question else _batch(agent, make_agent, args)
    except (ValueError, FileNotFoundError, GenerationError, SearchError, ServerStartError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _load(make_agent, args, stack, log_dir: Path):
    from search_r1.agents.chat import load_chat_model

    search, access = open_tools(args, stack, log_dir)
    model = load_chat_model(args.model, args.base_url, None if args.no_api_key else args.api_key_env, args.dtype,
                            timeout=args.request_timeout, max_concurrency=max(8, args.concurrency),
                            retries=args.retries, allow_insecure_http=args.allow_insecure_http)
    stack.callback(model.close)
    return make_agent(args, model, search, access, budgets_of(args))


def _single(agent: str, make_agent, args) -> int:
    from search_r1.evaluation.runner import write_atomic

    console = None if args.quiet else (lambda line: print(line, flush=True))
    with contextlib.ExitStack() as stack:
        out = Path(args.out) if args.out else None
        if out is None:  # a served index's log goes to a temp dir, not into the caller's directory
            import tempfile

            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="search_r1_agent_")))
        else:
            log_dir = out
        runner = _load(make_agent, args, stack, log_dir)
        if agent == "weaver":
            result = runner.run(args.question, out, console=console)
            print(f"\nAnswer: {result['answer'] if result['answer'] is not None else '(none)'}")
            print(f"Report: {result['report_path']}  (trace: {out / 'trace.json'})")
            for hit in result["budget"]["hits"]:
                print(f"Budget: {hit['budget']} {hit['used']}/{hit['limit']} in {hit['phase']}: {hit['then']}")
        else:
            result = runner.run(args.question, console=console)
            print("\n" + format_answer(result))
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                write_atomic(out / "result.json", json.dumps(result, indent=1, ensure_ascii=False) + "\n")
                print(f"Trace: {out / 'result.json'}")
    if result["error"]:
        print(f"error: {result['error']}", file=sys.stderr)
        return 1
    return 0


def _slug(qid: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", qid)[:120] or "question"


def format_answer(result: dict) -> str:
    """The answer with its sources, as printed for a single question."""
    lines = [f"Answer: {result['answer'] if result['answer'] is not None else '(none)'}"]
    if result.get("overflow"):
        lines.append(f"Context window full, answer forced: {result['overflow']}")
    if result["answer"] is None and result["final_text"].strip():
        lines.append(f"Final turn: {result['final_text'].strip()[:500]}")
    if result["sources"]:
        lines.append("Sources (cited):" if result["cited"] else "Sources (shown to the model, none cited):")
        lines += [f"  [Doc {s['number']}] {s['label']}" for s in result["sources"]]
    for hit in result["budget"]["hits"]:
        lines.append(f"Budget: {hit['budget']} {hit['used']}/{hit['limit']} in {hit['phase']}: {hit['then']}")
    return "\n".join(lines)


def prediction_record(example, result: dict) -> dict:
    """One predictions.jsonl line: the eval CLI's fields and scores, plus the agent's trace summary.
    format_valid is the agent's own check (valid tool calls / actions and an <answer>); the Search-R1
    tag grammar does not apply to agent transcripts, so the seed reward is not reported."""
    from search_r1.scoring import score_response

    rec = {"id": example.id, "data_source": example.data_source, "question": example.question,
           "golden_answers": list(example.golden_answers)}
    scores = score_response(result["response"], list(example.golden_answers))
    scores.pop("reward")
    scores["format_valid"] = float(result["format_valid"])
    if result["error"]:  # not scored: the run did not finish (see the module docstring)
        scores = dict.fromkeys(scores)
    rec.update(scores)
    rec.update({"answered": float(result["answer"] is not None), "turns": result["turns"],
                "searches": result["searches"], "search_queries": result["search_queries"],
                "budget_hits": result["budget"]["hits"], "seconds": result["budget"]["seconds"],
                "tokens": result["budget"]["tokens"], "error": result["error"], "response": result["response"]})
    for key in ("final_text", "sources", "cited", "tool_calls", "forced_answer", "overflow", "report_path",
                "outline"):
        if key in result:
            rec[key] = result[key]
    return rec


def failed_result(question: str, error: str) -> dict:
    """The result of a question whose run raised before the agent could record anything."""
    return {"question": question, "answer": None, "final_text": "", "response": "", "format_valid": False,
            "turns": 0, "searches": 0, "search_queries": [], "error": error,
            "budget": {"hits": [], "seconds": 0.0, "tokens": 0}}


def error_summary(records: list[dict]) -> dict:
    """{"n", "ids", "first"} of the records that ended in an error (not scored)."""
    failed = [r for r in records if r.get("error")]
    return {"n": len(failed), "ids": [r["id"] for r in failed], "first": failed[0]["error"] if failed else None}


def _batch(agent: str, make_agent, args) -> int:
    from tqdm import tqdm

    from search_r1.scoring import aggregate, markdown_table
    from search_r1.evaluation.runner import (PREDICTIONS, RESULTS, load_questions, prepare_out_dir, select_examples,
                                             write_atomic)
    from search_r1.rollout.backends import GenerationError
    from search_r1.search.base import SearchError

    out = Path(args.out)
    cfg = BatchConfig(str(out), args.overwrite, settings(agent, args))
    done = prepare_out_dir(cfg)
    examples = select_examples(load_questions(args.data), args.limit, args.limit_per_source, args.seed)
    # Errored questions are asked again; the rest of an earlier run is kept.
    pending = [ex for ex in examples if ex.id not in done or done[ex.id].get("error")]
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        runner = _load(make_agent, args, stack, out)
        if done:
            retried = sum(1 for ex in pending if ex.id in done)
            print(f"resuming: {len(examples) - len(pending)} of {len(examples)} questions already in "
                  f"{out / PREDICTIONS}" + (f"; retrying {retried} that ended in an error" if retried else ""),
                  file=sys.stderr)
        t_load = time.perf_counter() - t0
        lock = threading.Lock()
        bar = tqdm(total=len(pending), desc=agent, unit="q", disable=args.no_progress, dynamic_ncols=True)
        em: list[float] = []
        errors = 0

        def solve(ex):
            try:
                if agent == "weaver":
                    return ex, runner.run(ex.question, out / "runs" / _slug(ex.id))
                return ex, runner.run(ex.question)
            except (GenerationError, SearchError) as exc:  # the agents record these; this is the last net
                return ex, failed_result(ex.question, f"{type(exc).__name__}: {exc}")

        with open(out / PREDICTIONS, "a", encoding="utf-8") as f, \
                ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            futures = [pool.submit(solve, ex) for ex in pending]
            try:
                for future in as_completed(futures):
                    ex, result = future.result()
                    rec = prediction_record(ex, result)
                    with lock:
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                        f.flush()
                        done[rec["id"]] = rec
                        if rec["error"]:
                            errors += 1
                        else:
                            em.append(rec["em"])
                        bar.update(1)
                        bar.set_postfix(em=f"{sum(em) / len(em):.3f}" if em else "-", errors=errors)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        bar.close()
    seconds = time.perf_counter() - t0
    selected = [done[ex.id] for ex in examples if ex.id in done]
    failed = error_summary(selected)
    results = {"name": args.name or out.resolve().name, "model": args.model, "mode": f"agent:{agent}",
               "n": len(selected) - failed["n"], "errors": failed,
               "metrics": aggregate([r for r in selected if not r.get("error")]), "config": settings(agent, args),
               "timing": {"seconds": round(seconds, 2), "load_seconds": round(t_load, 2), "evaluated_now": len(pending),
                          "seconds_per_question": round((seconds - t_load) / max(1, len(pending)), 3)}}
    write_atomic(out / RESULTS, json.dumps(results, indent=2) + "\n")
    print(f"\n{results['name']} ({agent} agent, {results['n']} questions scored, model {args.model})")
    print(markdown_table(results["metrics"], keys=("em", "subem", "f1", "format_valid", "answered", "turns",
                                                   "searches")))
    if failed["n"]:
        print(f"\nerrors: {failed['n']} of {len(selected)} questions ended in an error and are not scored "
              f"(their `error` is in predictions.jsonl; running again retries them). First: {failed['first'][:300]}")
    print(f"\npredictions: {out / PREDICTIONS}\nresults:     {out / RESULTS}")
    if selected and failed["n"] == len(selected):
        print(f"error: every question ended in an error; first: {failed['first'][:500]}", file=sys.stderr)
        return 1
    return 0
