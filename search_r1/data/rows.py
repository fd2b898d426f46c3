"""One row of a Search-R1 parquet file: its schema, its messages, gold answers and question text.

Plain pandas / numpy (no torch, no verl), so tools that only read questions (the agents) load fast;
`dataset.PromptDataset` builds on it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from search_r1.prompts import TEMPLATES

EXPECTED_SCHEMA = (
    "data_source: str; prompt: list of {role, content} chat messages; ability: str (optional); "
    "reward_model: {style, ground_truth: {target: [answers]}}; extra_info: {split, index, ...} (optional)"
)
REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")


def as_list(value) -> list:
    """Parquet nested lists come back as numpy arrays; normalise them (and scalars) to a list."""
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def schema_error(path: Path, row: int | None, column: str, problem: str) -> ValueError:
    where = f"{path}" if row is None else f"{path} row {row}"
    return ValueError(
        f"{where}: column {column!r} {problem}. Expected the Search-R1 parquet schema: {EXPECTED_SCHEMA}"
    )


def parse_messages(value, path: Path, row: int) -> list[dict]:
    messages = as_list(value)
    if not messages:
        raise schema_error(path, row, "prompt", "is empty or missing")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise schema_error(path, row, "prompt", f"holds {m!r}, not a {{role, content}} message")
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    return out


def parse_targets(value, path: Path, row: int) -> list[str]:
    if not isinstance(value, dict) or not isinstance(value.get("ground_truth"), dict):
        raise schema_error(path, row, "reward_model", f"is {value!r}, without a ground_truth dict")
    gt = value["ground_truth"]
    if "target" not in gt:
        raise schema_error(path, row, "reward_model.ground_truth.target", "is missing")
    targets = [str(t) for t in as_list(gt["target"])]
    if not targets:
        raise schema_error(path, row, "reward_model.ground_truth.target", "is empty")
    return targets


def question_from_prompt(content: str) -> str | None:
    """Recover the raw question from an instruction built by `search_r1.prompts.make_prompt`."""
    for template in TEMPLATES.values():
        prefix = template.split("{question}")[0]
        suffix = template.split("{question}")[1]
        if content.startswith(prefix) and content.endswith(suffix):
            return content[len(prefix): len(content) - len(suffix)]
    marker = "Question: "
    if marker in content:
        return content.rsplit(marker, 1)[1].strip()
    return None


def recover_question(frame_row: dict, messages: list[dict]) -> str | None:
    if isinstance(frame_row.get("question"), str):
        return frame_row["question"]
    extra = frame_row.get("extra_info")
    if isinstance(extra, dict) and isinstance(extra.get("question"), str):
        return extra["question"]
    return question_from_prompt(messages[-1]["content"])


def read_frame(path: Path) -> pd.DataFrame:
    """The parquet file at `path`, checked for the required columns (ValueError naming the schema)."""
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise ValueError(f"cannot read {path} as parquet ({exc}); expected schema: {EXPECTED_SCHEMA}") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise schema_error(path, None, missing[0], f"is missing (file has columns {list(frame.columns)})")
    return frame
