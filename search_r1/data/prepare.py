"""Bring your own QA data: FlashRAG-layout files -> Search-R1 train/test parquet.

    python -m search_r1.data.prepare nq=nq.jsonl hotpotqa=hotpot_dev.parquet --out data/mine
    python -m search_r1.data.prepare nq:train=nq/train.jsonl nq:test=nq/test.jsonl --out data/nq \\
        --template chat --max-per-source 5000 --seed 1 --skip-bad

Inputs are `NAME=PATH` pairs: each file holds rows `{"id", "question", "golden_answers"}` as jsonl
(one JSON object per line), parquet or csv (`golden_answers` a JSON list or a single answer). NAME
becomes the rows' `data_source`; several files may share a NAME. `NAME:train=PATH` /
`NAME:test=PATH` put a whole file in one split; otherwise `--test-fraction` of each source (after a
seeded shuffle) goes to the test split.

Output: `DIR/train.parquet` and `DIR/test.parquet` in the Search-R1 format (rows built by
`search_r1.data.synth.search_r1_row`, the same builder as the synthetic world, so our trainer's
`PromptDataset` and verl's `RLHFDataset` both read them; `agent_name` selects verl's agent loop), and
`DIR/prepare_meta.json` (the command's settings and counts). Each row: `id` = "NAME:original id"
(unique over the whole output), `question` (stripped, ending in "?", as upstream), `golden_answers`,
`data_source`, `prompt` (chat messages of `--template`, text from `search_r1.prompts`), `ability`,
`agent_name`, `reward_model.ground_truth.target`, `extra_info` {split, index (per source and split,
from 0, as upstream), original_id, template}.

Bad rows (a missing or empty question / answer / id, a duplicate id within a source, a line that is
not UTF-8 or not a JSON object) are all listed with file and line, and the command fails; with
`--skip-bad` they are dropped and counted instead. A file missing a required column always fails.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from search_r1.prompts import DATA_TEMPLATES, normalize_question, template_messages

REQUIRED_KEYS = ("id", "question", "golden_answers")
SPLITS = ("train", "test")
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
MAX_PROBLEMS_SHOWN = 20
DEFAULT_TEST_FRACTION = 0.1
DEFAULT_ABILITY = "fact-reasoning"


class PrepareError(ValueError):
    """The inputs cannot be converted; the message names the file, line and fix."""


@dataclass(frozen=True)
class SourceSpec:
    """One `NAME[:SPLIT]=PATH` argument; split None = split by --test-fraction."""

    name: str
    path: Path
    split: str | None = None


@dataclass(frozen=True)
class Item:
    """One valid input row."""

    source: str
    split: str | None  # pinned split of its file, or None
    where: str  # "file:line" for messages
    original_id: str
    question: str
    answers: tuple[str, ...]


@dataclass
class ReadResult:
    items: list[Item] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # "file:line: what is wrong"


def parse_spec(text: str) -> SourceSpec:
    """`NAME=PATH` or `NAME:train=PATH` / `NAME:test=PATH` -> SourceSpec (ValueError naming the fix)."""
    if "=" not in text:
        raise PrepareError(f"input {text!r} is not NAME=PATH; write e.g. nq=data/nq_test.jsonl "
                           f"(NAME becomes the rows' data_source)")
    left, path = text.split("=", 1)
    name, _, split = left.partition(":")
    if not NAME_RE.match(name):
        raise PrepareError(f"source name {name!r} in {text!r} must be letters, digits, '_', '.' or '-'")
    if split and split not in SPLITS:
        raise PrepareError(f"split {split!r} in {text!r} must be one of {list(SPLITS)} (or leave it out "
                           f"to split by --test-fraction)")
    if not path:
        raise PrepareError(f"input {text!r} has an empty path")
    return SourceSpec(name, Path(path).expanduser(), split or None)


# -- reading --------------------------------------------------------------------------------------
def _file_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise PrepareError(f"{path}: unknown file type {path.suffix!r}; use .jsonl, .parquet or .csv "
                           f"with the columns {list(REQUIRED_KEYS)}")
    return fmt


def _as_answers(value) -> list | None:
    """golden_answers as a list (a single string or number becomes a one-element list)."""
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def validate_row(raw, source: str, split: str | None, where: str) -> Item | str:
    """An Item, or the problem with this row as text (without the location)."""
    if not isinstance(raw, dict):
        return f"expected a JSON object with keys {list(REQUIRED_KEYS)}, got {type(raw).__name__}"
    missing = [k for k in REQUIRED_KEYS if k not in raw or raw[k] is None]
    if missing:
        return f"missing {missing} (has keys {sorted(raw)[:8]})"
    qid = raw["id"]
    if isinstance(qid, float) and qid.is_integer():
        qid = int(qid)
    qid = str(qid).strip()
    if not qid:
        return "empty id"
    question = raw["question"]
    if not isinstance(question, str) or not question.strip():
        return f"empty or non-text question {question!r:.60}"
    answers = _as_answers(raw["golden_answers"])
    if answers is None:
        return f"golden_answers must be a list of strings, got {type(raw['golden_answers']).__name__}"
    answers = [str(a).strip() for a in answers if a is not None and str(a).strip()]
    if not answers:
        return "golden_answers is empty (no non-empty answer)"
    return Item(source, split, where, qid, normalize_question(question), tuple(answers))


def _read_jsonl(path: Path, spec: SourceSpec, out: ReadResult) -> None:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                out.problems.append(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not text.strip():
                continue
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                out.problems.append(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            _add(raw, spec, where, out)


def _read_parquet(path: Path, spec: SourceSpec, out: ReadResult) -> None:
    import pandas as pd

    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a broken or non-parquet file
        raise PrepareError(f"{path}: cannot read as parquet ({exc})") from None
    _check_columns(path, list(frame.columns))
    for i, raw in enumerate(frame.to_dict(orient="records")):
        _add(raw, spec, f"{path}:row {i}", out)


def _read_csv(path: Path, spec: SourceSpec, out: ReadResult) -> None:
    data = path.read_bytes()
    # surrogateescape keeps undecodable bytes as lone surrogates, so the parse goes on and the row
    # holding them is reported with its line instead of failing the whole file.
    text = data.decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    _check_columns(path, list(reader.fieldnames or []))
    start = 2  # line 1 is the header
    for raw in reader:
        where = f"{path}:{start}"
        start = reader.line_num + 1
        values = [v for v in raw.values() if isinstance(v, str)]
        if any(_has_surrogate(v) for v in values):
            out.problems.append(f"{where}: not UTF-8")
            continue
        answers = raw.get("golden_answers")
        if isinstance(answers, str) and answers.strip().startswith("["):
            try:
                raw["golden_answers"] = json.loads(answers)
            except json.JSONDecodeError as exc:
                out.problems.append(f"{where}: golden_answers looks like a JSON list but is not valid "
                                    f"JSON ({exc.msg})")
                continue
        _add(raw, spec, where, out)


def _has_surrogate(text: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def _check_columns(path: Path, columns: list[str]) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in columns]
    if missing:
        raise PrepareError(f"{path}: missing column(s) {missing} (file has {columns}); every input needs "
                           f"{list(REQUIRED_KEYS)} (the FlashRAG layout)")


def _add(raw, spec: SourceSpec, where: str, out: ReadResult) -> None:
    result = validate_row(raw, spec.name, spec.split, where)
    if isinstance(result, str):
        out.problems.append(f"{where}: {result}")
    else:
        out.items.append(result)


READERS = {"jsonl": _read_jsonl, "parquet": _read_parquet, "csv": _read_csv}


def read_sources(specs: list[SourceSpec]) -> ReadResult:
    """All rows of all inputs, bad rows (and duplicate ids within a source) as problems."""
    out = ReadResult()
    for spec in specs:
        if not spec.path.is_file():
            raise PrepareError(f"input file {spec.path} (for {spec.name}) does not exist")
        READERS[_file_format(spec.path)](spec.path, spec, out)
    seen: dict[tuple[str, str], str] = {}
    unique = []
    for item in out.items:
        key = (item.source, item.original_id)
        if key in seen:
            out.problems.append(f"{item.where}: duplicate id {item.original_id!r} in source {item.source!r} "
                                f"(first at {seen[key]})")
            continue
        seen[key] = item.where
        unique.append(item)
    out.items = unique
    return out


# -- splitting ------------------------------------------------------------------------------------
def split_items(items: list[Item], test_fraction: float, max_per_source: int | None,
                seed: int) -> dict[str, list[Item]]:
    """Rows per split. Per source: seeded shuffle; cap at max_per_source (per pinned split file
    group, or before splitting); the first round(test_fraction * n) unpinned rows go to test.
    Then each split is shuffled again by seed so sources interleave."""
    groups: dict[tuple[str, str | None], list[Item]] = {}
    for item in items:
        groups.setdefault((item.source, item.split), []).append(item)
    splits: dict[str, list[Item]] = {s: [] for s in SPLITS}
    for (source, pinned), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        rng = random.Random(f"{seed}:{source}:{pinned}")
        group = list(group)
        rng.shuffle(group)
        if max_per_source is not None:
            group = group[:max_per_source]
        if pinned is not None:
            splits[pinned].extend(group)
            continue
        n_test = round(test_fraction * len(group))
        splits["test"].extend(group[:n_test])
        splits["train"].extend(group[n_test:])
    for split in SPLITS:
        random.Random(f"{seed}:merge:{split}").shuffle(splits[split])
    return splits


def build_rows(items: list[Item], split: str, template: str, ability: str, agent_name: str) -> list[dict]:
    """Search-R1 rows (the synthetic world's builder); extra_info.index counts per source from 0."""
    from search_r1.data.synth import search_r1_row

    counters: dict[str, int] = {}
    rows = []
    for item in items:
        index = counters.get(item.source, 0)
        counters[item.source] = index + 1
        rows.append(search_r1_row(
            f"{item.source}:{item.original_id}", item.question, list(item.answers), item.source,
            template_messages(item.question, template),
            extra_info={"split": split, "index": index, "original_id": item.original_id, "template": template},
            ability=ability, agent_name=agent_name))
    return rows


def _schema():
    import pyarrow as pa

    strings = pa.list_(pa.string())
    return pa.schema([
        ("id", pa.string()), ("question", pa.string()), ("golden_answers", strings),
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()), ("agent_name", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.struct([("target", strings)]))])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("original_id", pa.string()),
                                  ("template", pa.string())])),
    ])


def write_parquet(rows: list[dict], path: Path) -> None:
    """Write atomically (a temp sibling renamed into place)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(path.name + ".part")
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=_schema()), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# -- the command ----------------------------------------------------------------------------------
def summary_table(splits: dict[str, list[Item]], dropped: dict[str, int], read: dict[str, int]) -> str:
    """Markdown table: rows per source and split, rows read and bad rows dropped."""
    sources = sorted(set(read) | {i.source for s in splits.values() for i in s})
    counts = {s: {split: 0 for split in SPLITS} for s in sources}
    for split, items in splits.items():
        for item in items:
            counts[item.source][split] += 1
    lines = ["| source | read | bad (dropped) | train | test |", "|---|---:|---:|---:|---:|"]
    for s in sources:
        lines.append(f"| {s} | {read.get(s, 0)} | {dropped.get(s, 0)} | {counts[s]['train']} | {counts[s]['test']} |")
    lines.append(f"| **total** | {sum(read.values())} | {sum(dropped.values())} | "
                 f"{len(splits['train'])} | {len(splits['test'])} |")
    return "\n".join(lines)


def _source_of_problem(problem: str, specs: list[SourceSpec]) -> str:
    for spec in specs:
        if problem.startswith(f"{spec.path}:"):
            return spec.name
    return "?"


def prepare(specs: list[SourceSpec], out_dir: Path, template: str = "base",
            test_fraction: float = DEFAULT_TEST_FRACTION, max_per_source: int | None = None, seed: int = 0,
            skip_bad: bool = False, ability: str = DEFAULT_ABILITY, agent_name: str = "search_r1") -> dict:
    """Run the conversion; returns {"paths", "counts", "dropped", "problems", "table"}.

    Raises PrepareError on bad arguments, unreadable files, or bad rows without `skip_bad`.
    """
    if not specs:
        raise PrepareError("no inputs; pass at least one NAME=PATH (e.g. nq=nq_test.jsonl)")
    if template not in DATA_TEMPLATES:
        raise PrepareError(f"--template {template!r} is unknown; choose one of {sorted(DATA_TEMPLATES)}")
    if not 0.0 <= test_fraction < 1.0:
        raise PrepareError(f"--test-fraction {test_fraction} must be in [0, 1)")
    if max_per_source is not None and max_per_source < 1:
        raise PrepareError(f"--max-per-source {max_per_source} must be >= 1")
    result = read_sources(specs)
    if result.problems and not skip_bad:
        shown = "\n  ".join(result.problems[:MAX_PROBLEMS_SHOWN])
        more = len(result.problems) - MAX_PROBLEMS_SHOWN
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise PrepareError(f"{len(result.problems)} bad row(s):\n  {shown}{tail}\nFix the rows, or pass "
                           f"--skip-bad to drop them (they are counted in the summary)")
    dropped: dict[str, int] = {}
    for p in result.problems:
        name = _source_of_problem(p, specs)
        dropped[name] = dropped.get(name, 0) + 1
    read = {}
    for item in result.items:
        read[item.source] = read.get(item.source, 0) + 1
    for name, n in dropped.items():
        read[name] = read.get(name, 0) + n
    if not result.items:
        raise PrepareError("no valid rows in the inputs (all were bad)")
    splits = split_items(result.items, test_fraction, max_per_source, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in SPLITS:
        path = out_dir / f"{split}.parquet"
        if splits[split]:
            write_parquet(build_rows(splits[split], split, template, ability, agent_name), path)
            paths[split] = str(path)
        elif path.exists():
            path.unlink()  # a stale split from an earlier run must not be mistaken for this one's
    table = summary_table(splits, dropped, read)
    meta = {"inputs": [{"name": s.name, "path": str(s.path), "split": s.split} for s in specs],
            "template": template, "test_fraction": test_fraction, "max_per_source": max_per_source,
            "seed": seed, "skip_bad": skip_bad, "ability": ability, "agent_name": agent_name,
            "counts": {split: len(items) for split, items in splits.items()}, "dropped": dropped,
            "problems": result.problems[:1000]}
    (out_dir / "prepare_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {"paths": paths, "counts": meta["counts"], "dropped": dropped, "problems": result.problems,
            "table": table}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m search_r1.data.prepare",
        description="Convert FlashRAG-layout QA files ({id, question, golden_answers} as jsonl, parquet or "
                    "csv) into Search-R1 train/test parquet files for training and evaluation.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="NAME=PATH",
                   help="input files; NAME becomes data_source (several files may share it). NAME:train=PATH "
                        "or NAME:test=PATH puts the whole file in that split instead of splitting it")
    p.add_argument("--out", type=Path, required=True, help="output directory (train.parquet, test.parquet, "
                   "prepare_meta.json)")
    p.add_argument("--template", default="base", choices=sorted(DATA_TEMPLATES),
                   help="prompt template: base = one user message with the Search-R1 instruction; chat = "
                        "system instruction + user question (instruct models); tool_call = the <tool_call> "
                        "JSON protocol")
    p.add_argument("--test-fraction", type=float, default=DEFAULT_TEST_FRACTION,
                   help="share of each unpinned source that goes to test.parquet (0 = all train)")
    p.add_argument("--max-per-source", type=int, default=None,
                   help="keep at most N rows per source (per split for NAME:SPLIT files), a seeded sample")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffles, the samples and the split")
    p.add_argument("--skip-bad", action="store_true",
                   help="drop bad rows (missing/empty fields, duplicate ids, non-UTF-8 or non-JSON lines) "
                        "and count them, instead of failing")
    p.add_argument("--ability", default=DEFAULT_ABILITY, help="the rows' `ability` column")
    p.add_argument("--agent-name", default="search_r1",
                   help="the rows' `agent_name` column: the verl agent loop that rolls them out")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        specs = [parse_spec(s) for s in args.inputs]
        res = prepare(specs, args.out, template=args.template, test_fraction=args.test_fraction,
                      max_per_source=args.max_per_source, seed=args.seed, skip_bad=args.skip_bad,
                      ability=args.ability, agent_name=args.agent_name)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if res["problems"]:
        print(f"dropped {len(res['problems'])} bad row(s) (--skip-bad); the first ones:", file=sys.stderr)
        for p in res["problems"][:5]:
            print(f"  {p}", file=sys.stderr)
    print(res["table"])
    for split, path in res["paths"].items():
        print(f"wrote {res['counts'][split]} {split} rows to {path}")
    if "test" not in res["paths"]:
        print("no test rows (--test-fraction 0 and no NAME:test input): test.parquet not written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
