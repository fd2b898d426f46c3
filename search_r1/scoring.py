"""Per-question scores, their aggregation per data_source, and the tables the eval CLI prints.

One scoring for the trainer's validation, the evaluation CLI and the agents, so it sits below all
three. The scoring functions are the training ones (`search_r1.rewards`), applied to the response text
only (generated tokens + inserted observations, never the prompt), decoded as the trainer decodes it.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

from search_r1.rewards import (check_format_correctness, compute_reward, em_score, extract_answer, f1_score,
                               subem_score)

# Mean-able fields of one prediction record, in table order: (record key, table header).
METRICS = (("em", "EM"), ("subem", "sub-EM"), ("f1", "F1"), ("format_valid", "format"),
           ("answered", "answered"), ("turns", "turns"), ("searches", "searches"), ("reward", "reward"))
TABLE_METRICS = ("em", "subem", "f1", "format_valid", "turns", "searches")
OVERALL = "overall"


def score_response(response_text: str, golden_answers: list[str]) -> dict:
    """The answer metrics of one response: prediction (last <answer>, or None), em, subem, f1,
    format_valid (1.0 if the Search-R1 format check passes) and reward (the training seed reward)."""
    return {
        "prediction": extract_answer(response_text),
        "em": em_score(response_text, golden_answers),
        "subem": subem_score(response_text, golden_answers),
        "f1": f1_score(response_text, golden_answers),
        "format_valid": float(check_format_correctness(response_text) > 0),
        "reward": compute_reward(response_text, golden_answers),
    }


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def aggregate(records: Iterable[dict]) -> dict:
    """{"overall": stats, "per_source": {data_source: stats}}; stats = {"n", and the mean of each
    METRICS key present in the records}. Every source weighs by its number of questions in overall."""
    groups: dict[str, list[dict]] = defaultdict(list)
    everything: list[dict] = []
    for r in records:
        groups[str(r["data_source"])].append(r)
        everything.append(r)

    def stats(rs: list[dict]) -> dict:
        out = {"n": len(rs)}
        for key, _ in METRICS:
            values = [float(r[key]) for r in rs if key in r and r[key] is not None]
            if values:
                out[key] = _mean(values)
        return out

    return {OVERALL: stats(everything), "per_source": {s: stats(rs) for s, rs in sorted(groups.items())}}


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3f}"


def markdown_table(metrics: dict, keys: tuple[str, ...] = TABLE_METRICS) -> str:
    """One run's metrics (the `aggregate` dict) as a markdown table: a row per source, then overall."""
    names = dict(METRICS)
    lines = ["| data_source | n | " + " | ".join(names[k] for k in keys) + " |",
             "|---|---:|" + "---:|" * len(keys)]
    rows = list(metrics["per_source"].items()) + [(f"**{OVERALL}**", metrics[OVERALL])]
    for source, s in rows:
        lines.append(f"| {source} | {s['n']} | " + " | ".join(_fmt(s.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def compare_table(results: list[dict], keys: tuple[str, ...] = ("em", "f1")) -> str:
    """Several runs side by side: a row per data_source (union over runs) and overall; for each run
    one column per metric in `keys`, headed "run name metric"; then a row with each run's n."""
    names = dict(METRICS)
    for k in keys:
        if k not in names:
            raise ValueError(f"unknown metric {k!r}; choose from {[m for m, _ in METRICS]}")
    runs = [(r.get("name") or f"run{i}", r["metrics"]) for i, r in enumerate(results)]
    sources = sorted({s for _, m in runs for s in m["per_source"]})
    header = "| data_source | " + " | ".join(f"{name} {names[k]}" for name, _ in runs for k in keys) + " |"
    lines = [header, "|---|" + "---:|" * (len(runs) * len(keys))]

    def row(label: str, pick) -> str:
        cells = []
        for _, m in runs:
            s = pick(m) or {}
            cells += [_fmt(s.get(k)) for k in keys]
        return f"| {label} | " + " | ".join(cells) + " |"

    for source in sources:
        lines.append(row(source, lambda m, s=source: m["per_source"].get(s)))
    lines.append(row(f"**{OVERALL}**", lambda m: m[OVERALL]))
    lines.append("| n | " + " | ".join(f"{m[OVERALL]['n']}" for _, m in runs for _ in keys) + " |")
    return "\n".join(lines)
