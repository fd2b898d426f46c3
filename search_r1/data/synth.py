"""Synthetic QA world: a fictional encyclopedia plus single- and two-hop questions about it.

    python -m search_r1.data.synth --out DIR --seed 0 --n-entities 1000

Everything is made up (names are random syllables), so a model cannot answer from memory and must
search. The same seed gives the same bytes in every output file. Output directory:

    corpus.jsonl              {"id": "0", "contents": "\\"Title\\"\\ntext"}  (wiki-18 format)
    train.parquet, test.parquet   Search-R1 rows: data_source, prompt, ability, reward_model,
                              extra_info, agent_name (verl's agent loop; + id, question,
                              golden_answers for converters)
    train.jsonl, test.jsonl   {"id", "question", "golden_answers", "data_source", "gold_doc_ids"}
    meta.json                 counts and parameters; written last, so its presence marks a
                              complete world

Sizes: about 2.5 passages per entity (1,000 entities -> ~2,500 passages in about a second;
400,000 entities -> ~1M passages). The corpus is streamed to disk entity by entity; only the world's
entities and the selected questions are kept in memory.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

from json.encoder import encode_basestring_ascii as _json_str

from tqdm import tqdm

from search_r1.data.passages import disambiguation_passages, entity_passages, template_vocabulary
from search_r1.data.questions import TWO_HOP, Question, candidate_questions, normalize, words
from search_r1.data.world import MIN_ENTITIES, World, build_world

DEFAULT_N_ENTITIES = 1000
DEFAULT_TEST_FRACTION = 0.1
DEFAULT_MAX_TRAIN = 20_000
DEFAULT_MAX_TEST = 2_000
ABILITY = "fact-reasoning"
DEFAULT_AGENT_NAME = "search_r1"  # verl_ext.agent_loop.SearchR1AgentLoop's registered name
FORMAT_VERSION = 1

# The modules whose code decides a world's bytes: a world written by another version of them is stale.
GENERATOR_MODULES = ("synth.py", "world.py", "names.py", "passages.py", "questions.py")

FILES = {
    "corpus": "corpus.jsonl",
    "train_parquet": "train.parquet",
    "test_parquet": "test.parquet",
    "train_jsonl": "train.jsonl",
    "test_jsonl": "test.jsonl",
    "meta": "meta.json",
}


def generator_fingerprint() -> str:
    """sha256 (first 16 hex digits) of the generator's source files: changes whenever they do."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in GENERATOR_MODULES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes())
    return h.hexdigest()[:16]


def stale_reason(out_dir, seed: int = 0, n_entities: int = DEFAULT_N_ENTITIES) -> str | None:
    """Why the world in `out_dir` is not the one `generate_world(out_dir, seed, n_entities)` would
    write now (missing, other seed or size, older generator), or None when it is current."""
    meta_path = Path(out_dir) / FILES["meta"]
    if not meta_path.is_file():
        return "no complete world there"
    meta = json.loads(meta_path.read_text())
    if meta.get("seed") != seed:
        return f"it was generated with seed {meta.get('seed')}, not {seed}"
    if meta.get("n_entities") != n_entities:
        return f"it has {meta.get('n_entities')} entities, not {n_entities}"
    if meta.get("generator") != generator_fingerprint():
        return "it was written by another version of the generator"
    return None


def ensure_world(out_dir, seed: int = 0, n_entities: int = DEFAULT_N_ENTITIES, progress: bool = True) -> Path:
    """Generate the world into `out_dir` unless an identical one is already there; returns out_dir."""
    reason = stale_reason(out_dir, seed, n_entities)
    if reason is not None:
        print(f"[synth] generating the synthetic QA world in {out_dir} (seed {seed}): {reason}",
              file=sys.stderr, flush=True)
        generate_world(out_dir, seed=seed, n_entities=n_entities, progress=progress)
    return Path(out_dir)


@contextlib.contextmanager
def _atomic(path: Path):
    """Yield a temporary sibling of `path` to write; it replaces `path` only if the block succeeds,
    so a reader never sees a half-written file under the final name."""
    tmp = path.with_name(path.name + ".part")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _select_questions(w: World, seed: int, test_fraction: float, max_train: int, max_test: int):
    """Questions per split. Splits are by subject entity (a test subject never appears in a train
    question), drawn in a seeded random order until both caps are reached."""
    rng = random.Random(f"{seed}-questions")
    order = list(range(len(w.entities)))
    rng.shuffle(order)
    n_test_entities = round(test_fraction * len(order))
    # Two-hop questions may be dropped later (see _TwoHopGuard), so pick a surplus and trim after.
    caps = {"train": max_train + max_train // 4 + 10, "test": max_test + max_test // 4 + 10}
    picked: dict[str, list[Question]] = {"train": [], "test": []}
    for rank, eid in enumerate(order):
        split = "test" if rank < n_test_entities else "train"
        room = caps[split] - len(picked[split])
        if room > 0:
            picked[split].extend(candidate_questions(w.entities[eid], w, rng)[:room])
        elif split == "train":
            break
    return picked


class _TwoHopGuard:
    """Marks a two-hop question invalid when one passage mentions both its subject and an answer
    alias: such a question could be answered with a single search. Subject names are found by their
    first token, so scanning a passage costs one dict lookup per word."""

    def __init__(self, questions: list[Question]):
        # first word of a subject -> [(normalized subject, [(question, normalized aliases)])]
        self.by_first: dict[str, list[tuple[str, list]]] = {}
        by_subject: dict[str, list] = {}
        for q in questions:
            if q.data_source == TWO_HOP:
                by_subject.setdefault(q.subject, []).append((q, [normalize(a) for a in q.answers]))
        for subject, qs in by_subject.items():
            self.by_first.setdefault(words(subject)[0], []).append((normalize(subject), qs))

    def scan(self, contents: str) -> None:
        toks = words(contents)
        firsts = self.by_first.keys() & toks  # set intersection in C; usually empty
        if not firsts:
            return
        text = " " + " ".join(toks) + " "
        for subject, qs in (entry for t in firsts for entry in self.by_first[t]):
            if subject in text:
                for q, answers in qs:
                    if q.valid and any(a in text for a in answers):
                        q.valid = False


def _write_corpus(path: Path, w: World, seed: int, questions: list[Question], progress: bool) -> int:
    """Stream every passage to `path`; fill each question's gold_doc_ids; return the passage count."""
    rng = random.Random(f"{seed}-text")
    gold: dict[tuple, list[str]] = {f: [] for q in questions for f in q.chain}
    guard = _TwoHopGuard(questions)
    pid = 0
    with _atomic(path) as tmp, open(tmp, "w", encoding="utf-8") as f:

        def emit(title: str, text: str, facts=()) -> None:
            nonlocal pid
            contents = f'"{title}"\n{text}'
            doc_id = str(pid)
            # Same bytes as json.dumps({"id": ..., "contents": ...}) with the C string encoder
            # called directly: json.dumps of a dict costs more than writing the passage.
            f.write(f'{{"id": "{doc_id}", "contents": {_json_str(contents)}}}\n')
            for fact in facts:
                ids = gold.get(fact)
                if ids is not None:
                    ids.append(doc_id)
            guard.scan(contents)
            pid += 1

        for e in tqdm(w.entities, desc="corpus", unit="entity", disable=not progress,
                      mininterval=0.5):
            for title, text, facts in entity_passages(e, w, rng):
                emit(title, text, facts)
        for title, text in disambiguation_passages(w):
            emit(title, text)
    for q in questions:
        q.gold_doc_ids = sorted({d for fact in q.chain for d in gold[fact]}, key=int)
    return pid


def _parquet_schema():
    import pyarrow as pa

    strings = pa.list_(pa.string())
    return pa.schema([
        ("id", pa.string()),
        ("question", pa.string()),
        ("golden_answers", strings),
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("agent_name", pa.string()),
        ("reward_model", pa.struct([
            ("style", pa.string()),
            ("ground_truth", pa.struct([("target", strings)])),
        ])),
        ("extra_info", pa.struct([
            ("split", pa.string()),
            ("index", pa.int64()),
            ("hops", pa.int64()),
            ("subject", pa.string()),
            ("bridge", pa.string()),
            ("follow_up", pa.string()),
            ("gold_doc_ids", strings),
        ])),
    ])


def search_r1_row(qid: str, question: str, answers: list[str], data_source: str, prompt: list[dict],
                  extra_info: dict, ability: str = ABILITY, agent_name: str = DEFAULT_AGENT_NAME) -> dict:
    """One Search-R1 parquet row, readable by our `PromptDataset` and by verl's `RLHFDataset`.

    `agent_name` picks the verl agent loop that rolls the row out (verl's AgentLoopWorker reads it
    per row; without it every row falls back to `rollout.agent.default_agent_loop`).
    """
    return {
        "id": qid, "question": question, "golden_answers": list(answers),
        "data_source": data_source,
        "prompt": prompt,
        "ability": ability,
        "agent_name": agent_name,
        "reward_model": {"style": "rule", "ground_truth": {"target": list(answers)}},
        "extra_info": extra_info,
    }


def _write_split(split: str, questions: list[Question], jsonl_path: Path, parquet_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from search_r1.prompts import make_messages

    rows = []
    with _atomic(jsonl_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for index, q in enumerate(questions):
            qid = f"{split}_{index}"
            record = {"id": qid, "question": q.text, "golden_answers": q.answers,
                      "data_source": q.data_source, "gold_doc_ids": q.gold_doc_ids}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            rows.append(search_r1_row(
                qid, q.text, q.answers, q.data_source, make_messages(q.text),
                extra_info={"split": split, "index": index, "hops": len(q.chain),
                            "subject": q.subject, "bridge": q.bridge, "follow_up": q.follow_up,
                            "gold_doc_ids": q.gold_doc_ids}))
    table = pa.Table.from_pylist(rows, schema=_parquet_schema())
    with _atomic(parquet_path) as tmp:
        pq.write_table(table, tmp)


def generate_world(out_dir, seed: int = 0, n_entities: int = DEFAULT_N_ENTITIES,
                   test_fraction: float = DEFAULT_TEST_FRACTION, max_train: int = DEFAULT_MAX_TRAIN,
                   max_test: int = DEFAULT_MAX_TEST, progress: bool = True) -> dict[str, Path]:
    """Generate a world into `out_dir` (created; existing files are replaced, each atomically).

    Returns the output paths keyed "dir", "corpus", "train_parquet", "test_parquet", "train_jsonl",
    "test_jsonl", "meta". Raises ValueError on out-of-range arguments.
    """
    if not isinstance(n_entities, int) or n_entities < MIN_ENTITIES:
        raise ValueError(f"n_entities={n_entities!r}: must be an integer >= {MIN_ENTITIES}")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r}: must be in [0, 1)")
    for key, value in (("max_train", max_train), ("max_test", max_test)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{key}={value!r}: must be an integer >= 0")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / name for k, name in FILES.items()}
    if paths["meta"].exists():
        paths["meta"].unlink()  # the world is incomplete until meta.json is written again

    w = build_world(n_entities, random.Random(seed), template_vocabulary())
    picked = _select_questions(w, seed, test_fraction, max_train, max_test)
    n_passages = _write_corpus(paths["corpus"], w, seed, picked["train"] + picked["test"], progress)

    rng = random.Random(f"{seed}-order")
    meta: dict = {"format_version": FORMAT_VERSION, "generator": generator_fingerprint(),
                  "seed": seed, "n_entities": n_entities,
                  "n_passages": n_passages, "test_fraction": test_fraction,
                  "max_train": max_train, "max_test": max_test, "splits": {}}
    for split in ("train", "test"):
        qs = [q for q in picked[split] if q.valid]
        qs = qs[:max_train if split == "train" else max_test]
        rng.shuffle(qs)  # interleave subjects and hop counts
        _write_split(split, qs, paths[f"{split}_jsonl"], paths[f"{split}_parquet"])
        by_source: dict[str, int] = {}
        for q in qs:
            by_source[q.data_source] = by_source.get(q.data_source, 0) + 1
        meta["splits"][split] = {"n_questions": len(qs),
                                 "by_data_source": dict(sorted(by_source.items()))}
    kinds: dict[str, int] = {}
    for e in w.entities:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    meta["entities_by_kind"] = dict(sorted(kinds.items()))
    with _atomic(paths["meta"]) as tmp:
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return {"dir": out, **paths}


def _parser() -> argparse.ArgumentParser:
    from search_r1.paths import default_synth_dir

    p = argparse.ArgumentParser(
        prog="python -m search_r1.data.synth",
        description="Generate a fictional QA world: a wiki-18 style corpus.jsonl, single-hop "
                    "(synth_nq) and two-hop (synth_hotpotqa) questions as Search-R1 train/test "
                    "parquet and raw jsonl. Same seed -> identical files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=default_synth_dir(),
                   help="output directory (created if missing; existing world files are replaced)")
    p.add_argument("--seed", type=int, default=0, help="random seed; fixes every output byte")
    p.add_argument("--n-entities", type=int, default=DEFAULT_N_ENTITIES,
                   help=f"number of entities (people, cities, companies, ...), at least {MIN_ENTITIES}; "
                        "the corpus has about 2.5 passages per entity (400000 -> ~1M passages)")
    p.add_argument("--test-fraction", type=float, default=DEFAULT_TEST_FRACTION,
                   help="share of subject entities whose questions go to the test split")
    p.add_argument("--max-train", type=int, default=DEFAULT_MAX_TRAIN,
                   help="at most this many train questions")
    p.add_argument("--max-test", type=int, default=DEFAULT_MAX_TEST,
                   help="at most this many test questions")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--if-stale", action="store_true",
                   help="do nothing when --out already holds this world (same seed and entities, "
                        "written by this version of the generator); otherwise generate it")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    if args.if_stale and stale_reason(args.out, args.seed, args.n_entities) is None:
        print(f"{args.out} already holds this world (seed {args.seed}); nothing to do")
        return 0
    try:
        paths = generate_world(args.out, seed=args.seed, n_entities=args.n_entities,
                               test_fraction=args.test_fraction, max_train=args.max_train,
                               max_test=args.max_test, progress=not args.no_progress)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    meta = json.loads(paths["meta"].read_text())
    splits = meta["splits"]
    print(f"wrote {meta['n_passages']} passages, {splits['train']['n_questions']} train and "
          f"{splits['test']['n_questions']} test questions to {paths['dir']} "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
