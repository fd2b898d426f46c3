"""Supervised warm-start of a small model on the report agent's formats (planner, summarizer, outline,
writer, answer), so the report agent (search_r1.agents.weaver) can write reports with it.

The demonstrations are the report agent's own calls while `ReportTeacher` plays its roles on training
questions of the synthetic world (search_r1.agents.report_teacher): each call's messages, tokenized
with the model's chat template exactly as `LocalChatModel` sends them, and the teacher's reply as the
target (loss on the reply's tokens only). A question's calls are kept only when the teacher's run was
a demonstration worth learning (`demonstration_run`: the evidence was retrieved, every section written,
the gold answer given). Training is the search warm-start's masked SFT (search_r1.trainer.warmstart.train);
the result is cached like it, under `$SEARCH_R1_HOME/warmstart/report-<key>`, the key hashing the base
model, the settings and the exact demonstration tokens.
"""
from __future__ import annotations

import random
import tempfile
from collections import Counter
from pathlib import Path

from search_r1.agents.report_teacher import Recorder, ReportTeacher, demonstration_run
from search_r1.agents.weaver import WeaverAgent
from search_r1.trainer.warmstart import FORMAT_VERSION, Demo, _train_rows, reused, settings_key, train_and_save


def tokenize_call(tokenizer, messages: list[dict], reply: str) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one agent call: the chat-templated conversation with the generation
    prompt (mask 0; what `LocalChatModel.encode` builds for a conversation ending with a user turn),
    then the reply's tokens (mask 1)."""
    from search_r1.prompts import apply_chat_template

    if messages[-1]["role"] != "user":
        raise ValueError("a demonstration call must end with a user message (the agent's own calls do)")
    prompt = apply_chat_template(tokenizer, messages)
    target = tokenizer(reply, add_special_tokens=False)["input_ids"]
    return prompt + target, [0] * len(prompt) + [1] * len(target)


def report_demos(rows: list[dict], search, access, tokenizer, n_questions: int, seed: int,
                 two_hop_share: float = 0.75, max_tokens: int = 2048) -> tuple[list[Demo], dict]:
    """Demonstrations from the teacher's runs on up to `n_questions` kept training questions (a seeded
    shuffle, `two_hop_share` of them two-hop), and counts of what was kept and skipped and why."""
    rng = random.Random(seed)
    by_hops = {h: [r for r in rows if r["hops"] == h] for h in (1, 2)}
    for pool in by_hops.values():
        rng.shuffle(pool)
    want = {2: round(n_questions * two_hop_share), 1: n_questions - round(n_questions * two_hop_share)}
    teacher = ReportTeacher(rows)
    demos: list[Demo] = []
    stats: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="report-demos-") as work:
        for hops in (2, 1):
            kept = 0
            for i, row in enumerate(by_hops[hops]):
                if kept >= want[hops]:
                    break
                recorder = Recorder(teacher)
                result = WeaverAgent(recorder, search, access).run(row["question"], Path(work) / f"{hops}-{i}")
                why = demonstration_run(result, row)
                if why is not None:
                    stats[f"skipped_{why}"] += 1
                    continue
                calls = [(c, *tokenize_call(tokenizer, c["messages"], c["reply"])) for c in recorder.calls]
                if any(len(ids) > max_tokens for _, ids, _ in calls):
                    stats["skipped_too_long"] += 1
                    continue
                kept += 1
                stats[f"kept_{hops}_hop"] += 1
                for call, ids, mask in calls:
                    stats[f"calls_{call['role']}"] += 1
                    demos.append(Demo(row["question"], tuple(row["golden_answers"]), call["reply"], tuple(ids),
                                      tuple(mask), mask.index(1), hops))
    return demos, dict(stats)


def ensure_report_warmstart(model_name: str, search, access, train_files, *, n_questions: int = 48,
                            steps: int = 60, batch_size: int = 8, lr: float = 1e-4, seed: int = 0,
                            two_hop_share: float = 0.75, compute_dtype: str = "float32", threads: int = 2,
                            cache_root: Path | None = None, progress: bool = True) -> tuple[Path, dict]:
    """Path of the report warm-start (built now or reused) and its meta dict (see the module docstring)."""
    from search_r1.models import load_tokenizer
    from search_r1.paths import home

    tokenizer = load_tokenizer(model_name)
    demos, stats = report_demos(_train_rows(train_files), search, access, tokenizer, n_questions, seed, two_hop_share)
    if not demos:
        raise ValueError(f"no report demonstration could be built from {list(map(str, train_files))}: {stats} "
                         "(the teacher needs the synthetic world's training questions and its retriever)")
    settings = dict(n_questions=n_questions, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                    two_hop_share=two_hop_share, compute_dtype=compute_dtype)
    root = Path(cache_root) if cache_root is not None else home() / "warmstart"
    target = root / f"report-{settings_key(model_name, demos, kind='report', **settings)}"
    meta = reused(target, "report warm-start")
    if meta is not None:
        return target, meta
    print(f"[report warm-start] SFT on {len(demos)} calls of {stats.get('kept_2_hop', 0)} two-hop and "
          f"{stats.get('kept_1_hop', 0)} single-hop teacher runs, {steps} steps x {batch_size}, lr {lr}", flush=True)
    meta = {"format_version": FORMAT_VERSION, "kind": "report", "base_model": model_name, "n_demos": len(demos),
            "demos": stats, **settings}
    meta = train_and_save(model_name, tokenizer, demos, target, meta, threads=threads, label="report warm-start",
                          steps=steps, batch_size=batch_size, lr=lr, seed=seed, compute_dtype=compute_dtype,
                          progress=progress)
    return target, meta
