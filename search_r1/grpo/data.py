"""Training data for the single-process API: the synthetic world's questions, jsonl/csv loaders, and a
keyword knowledge base over the world's passages (an offline `MockSearchEngine`).

    queries, answers = create_training_data(16)                  # from the synthetic QA world
    queries, answers = load_training_data("qa.jsonl")            # {"question", "golden_answers"} rows
    engine = MockSearchEngine(synthetic_knowledge_base())        # entity name -> its passages

The world is generated once (about a second) under `search_r1.paths.default_synth_dir()` and
reused; every question there is about made-up entities, so a model has to search to answer.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from search_r1.search.format import render_passages

QUESTION_KEYS = ("question", "query", "prompt")
ANSWER_KEYS = ("golden_answers", "answers", "answer", "ground_truth", "target")
CSV_ANSWER_SEPARATOR = "|"


def _world_dir(synth_dir: str | os.PathLike | None) -> Path:
    from search_r1.data.synth import ensure_world
    from search_r1.paths import default_synth_dir

    if synth_dir is not None:
        directory = Path(synth_dir)
        if not (directory / "meta.json").is_file():
            raise ValueError(f"{directory} holds no synthetic world (no meta.json); generate one with "
                             f"`python -m search_r1.data.synth --out {directory}` or pass synth_dir=None")
        return directory
    return ensure_world(default_synth_dir(), progress=False)


def create_training_data(n: int = 16, split: str = "train", synth_dir: str | os.PathLike | None = None,
                         ) -> tuple[list[str], list[list[str]]]:
    """The first `n` questions of the synthetic world's `split` ("train" or "test") and their gold
    answers (a list of aliases each). `synth_dir` None = the default world, generated if missing."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    queries, answers = load_training_data(_world_dir(synth_dir) / f"{split}.jsonl", limit=n)
    return queries, answers


def synthetic_knowledge_base(synth_dir: str | os.PathLike | None = None, max_docs: int = 3) -> dict[str, str]:
    """Entity title -> its first `max_docs` passages rendered as `Doc i(Title: ..) ..` lines.

    For `MockSearchEngine`, whose query matches the longest title it contains (case-insensitive).
    """
    groups: dict[str, list[str]] = {}
    with open(_world_dir(synth_dir) / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            contents = json.loads(line)["contents"]
            title = contents.partition("\n")[0].strip().strip('"')
            if title:
                docs = groups.setdefault(title, [])
                if len(docs) < max_docs:
                    docs.append(contents)
    return {title: render_passages(docs) for title, docs in groups.items()}


def load_training_data(path: str | os.PathLike, limit: int | None = None) -> tuple[list[str], list[list[str]]]:
    """(queries, ground truths) from a .jsonl or .csv file.

    jsonl: one object per line with a question key (`question` | `query` | `prompt`) and an answer
    key (`golden_answers` | `answers` | `answer` | `ground_truth` | `target`, a string or a list).
    csv: a header row with the same names; several gold answers in one cell are separated by "|".
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"training data file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            rows = [(i, json.loads(line)) for i, line in enumerate(f, 1) if line.strip()]
    elif suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            rows = [(i, row) for i, row in enumerate(csv.DictReader(f), 2)]
    else:
        raise ValueError(f"unsupported training data file {path}: use .jsonl or .csv")
    queries, answers = [], []
    for line_no, row in rows[:limit]:
        question = _first(row, QUESTION_KEYS, path, line_no)
        gold = _first(row, ANSWER_KEYS, path, line_no)
        if isinstance(gold, dict) and "target" in gold:  # Search-R1's reward_model.ground_truth
            gold = gold["target"]
        if isinstance(gold, str):
            gold = [g.strip() for g in gold.split(CSV_ANSWER_SEPARATOR)] if suffix == ".csv" else [gold]
        if not isinstance(question, str) or not isinstance(gold, list) or not all(isinstance(g, str) for g in gold):
            raise ValueError(f"{path} line {line_no}: the question must be a string and the answers a string "
                             f"or a list of strings")
        queries.append(question)
        answers.append(gold)
    if not queries:
        raise ValueError(f"{path} holds no rows")
    return queries, answers


def _first(row: dict, keys: tuple[str, ...], path: Path, line_no: int):
    for key in keys:
        if key in row and row[key] not in (None, ""):
            return row[key]
    raise ValueError(f"{path} line {line_no}: none of the columns {list(keys)} is present (got {sorted(row)})")
