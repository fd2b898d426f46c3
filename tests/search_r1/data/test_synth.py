"""Synthetic QA world: determinism, answerability, two-hop structure, file schemas, CLI.

Most checks read the session `synth_world` (seed 0, ~300 passages). Text checks use their own
whole-word, case-insensitive regex rather than the generator's helpers, so a bug in those helpers
cannot hide itself.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from search_r1.data.synth import FILES, generate_world
from search_r1.prompts import make_prompt
from search_r1.search.format import split_title
from tests._fixtures.synth import SYNTH_WORLD_ENTITIES, SYNTH_WORLD_SEED

SPLITS = ("train", "test")
SOURCES = {"synth_nq", "synth_hotpotqa"}


def _has(text: str, phrase: str) -> bool:
    return re.search(r"\b" + re.escape(phrase) + r"\b", text, flags=re.IGNORECASE) is not None


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def corpus(synth_world) -> dict[str, str]:
    return {d["id"]: d["contents"] for d in _jsonl(synth_world / "corpus.jsonl")}


@pytest.fixture(scope="module")
def rows(synth_world) -> dict[str, list[dict]]:
    """Parquet rows per split (nested columns as Python dicts/lists)."""
    return {s: pq.read_table(synth_world / f"{s}.parquet").to_pylist() for s in SPLITS}


# ---------------------------------------------------------------- determinism


def test_same_seed_gives_identical_bytes(synth_world, tmp_path):
    again = generate_world(tmp_path, seed=SYNTH_WORLD_SEED, n_entities=SYNTH_WORLD_ENTITIES,
                           progress=False)
    for key, name in FILES.items():
        assert again[key].read_bytes() == (synth_world / name).read_bytes(), name


def test_different_seed_gives_different_world(synth_world, tmp_path):
    other = generate_world(tmp_path, seed=SYNTH_WORLD_SEED + 1, n_entities=SYNTH_WORLD_ENTITIES,
                           progress=False)
    for key in ("corpus", "train_jsonl", "test_jsonl", "train_parquet", "test_parquet"):
        assert other[key].read_bytes() != (synth_world / FILES[key]).read_bytes(), key


def test_generate_world_returns_paths_and_meta(synth_world):
    meta = json.loads((synth_world / "meta.json").read_text())
    n_lines = sum(1 for _ in open(synth_world / "corpus.jsonl"))
    assert meta["n_passages"] == n_lines
    assert 200 <= n_lines <= 1000  # "a few hundred passages" for tests
    assert meta["seed"] == SYNTH_WORLD_SEED and meta["n_entities"] == SYNTH_WORLD_ENTITIES
    assert sorted(p.name for p in synth_world.iterdir()) == sorted(FILES.values())  # no .part left
    for split in SPLITS:
        n = sum(1 for _ in open(synth_world / f"{split}.jsonl"))
        assert meta["splits"][split]["n_questions"] == n > 0


def test_stale_worlds_are_regenerated_and_current_ones_kept(synth_world, tmp_path, capsys):
    import shutil

    from search_r1.data.synth import ensure_world, main, stale_reason
    world = tmp_path / "world"
    shutil.copytree(synth_world, world)
    args = dict(seed=SYNTH_WORLD_SEED, n_entities=SYNTH_WORLD_ENTITIES)
    assert stale_reason(world, **args) is None
    stamp = (world / "meta.json").stat().st_mtime_ns
    ensure_world(world, progress=False, **args)
    assert (world / "meta.json").stat().st_mtime_ns == stamp  # current: left alone
    cli = ["--out", str(world), "--seed", str(SYNTH_WORLD_SEED), "--n-entities", str(SYNTH_WORLD_ENTITIES),
           "--if-stale", "--no-progress"]
    assert main(cli) == 0 and "nothing to do" in capsys.readouterr().out
    assert (world / "meta.json").stat().st_mtime_ns == stamp
    assert "seed" in stale_reason(world, seed=SYNTH_WORLD_SEED + 1, n_entities=SYNTH_WORLD_ENTITIES)
    assert "entities" in stale_reason(world, seed=SYNTH_WORLD_SEED, n_entities=SYNTH_WORLD_ENTITIES + 10)
    assert "no complete world" in stale_reason(tmp_path / "missing", **args)
    # a world written by another version of the generator (what an upgrade leaves in the cache)
    meta = json.loads((world / "meta.json").read_text())
    meta["generator"] = "0" * 16
    (world / "meta.json").write_text(json.dumps(meta))
    (world / "train.jsonl").write_text("")  # its questions differed
    assert "version of the generator" in stale_reason(world, **args)
    assert main(cli) == 0
    assert stale_reason(world, **args) is None
    for name in FILES.values():
        assert (world / name).read_bytes() == (synth_world / name).read_bytes(), name


# ---------------------------------------------------------------- corpus


def test_corpus_is_wiki18_jsonl(corpus):
    assert list(corpus) == [str(i) for i in range(len(corpus))]  # unique, dense string ids
    for contents in corpus.values():
        assert re.match(r'^"[^"\n]+"\n\S', contents), contents
        title, text = split_title(contents)
        assert title and len(text.split()) >= 4


def test_entities_have_several_passages_and_distractors_share_names(corpus):
    titles = [split_title(c)[0] for c in corpus.values()]
    per_title: dict[str, int] = {}
    for t in titles:
        per_title[t] = per_title.get(t, 0) + 1
    assert sum(n >= 2 for n in per_title.values()) >= len(per_title) // 2
    surname_pages = [t for t in titles if t.endswith("(surname)")]
    assert surname_pages
    # a surname page lists several people who share the surname: a BM25 distractor for each
    surname = surname_pages[0].removesuffix(" (surname)")
    sharing = {t for t in titles if t.endswith(" " + surname)}
    assert len(sharing) >= 2


# ---------------------------------------------------------------- questions


def _all_questions(synth_world):
    return [q for s in SPLITS for q in _jsonl(synth_world / f"{s}.jsonl")]


def test_every_gold_answer_appears_in_its_gold_passages(synth_world, corpus, rows):
    for split in SPLITS:
        for row in rows[split]:
            answers = row["golden_answers"]
            gold = [corpus[i] for i in row["extra_info"]["gold_doc_ids"]]
            assert gold, row["id"]
            for alias in answers:
                assert any(_has(g, alias) for g in gold), (row["id"], alias)
            if row["data_source"] == "synth_nq":
                # every passage stating the fact has the subject and the answer
                for g in gold:
                    assert _has(g, row["extra_info"]["subject"]) and _has(g, answers[0]), row["id"]


def test_questions_name_their_subject_verbatim(rows):
    for split in SPLITS:
        for row in rows[split]:
            info = row["extra_info"]
            assert info["subject"] in row["question"], row["question"]
            if row["data_source"] == "synth_hotpotqa":
                assert info["hops"] == 2 and info["bridge"]
                assert not _has(row["question"], info["bridge"]), row["question"]
            else:
                assert info["hops"] == 1 and info["bridge"] == ""
            for alias in row["golden_answers"]:
                assert not _has(row["question"], alias), row["question"]


def test_two_hop_questions_need_two_passages(corpus, rows):
    """No single passage holds both the question's entity and any answer alias; the gold passages
    reach the answer through the bridge entity."""
    two_hop = [r for s in SPLITS for r in rows[s] if r["data_source"] == "synth_hotpotqa"]
    assert len(two_hop) >= 20
    docs = list(corpus.values())
    for row in two_hop:
        subject, bridge = row["extra_info"]["subject"], row["extra_info"]["bridge"]
        with_subject = [d for d in docs if _has(d, subject)]
        assert with_subject
        for d in with_subject:
            assert not any(_has(d, a) for a in row["golden_answers"]), (row["question"], d)
        gold = [corpus[i] for i in row["extra_info"]["gold_doc_ids"]]
        # hop 1: a gold passage links subject and bridge; hop 2: another links bridge and answer
        assert any(_has(g, subject) and _has(g, bridge) for g in gold), row["question"]
        assert any(_has(g, bridge) and _has(g, row["golden_answers"][0]) for g in gold)


def test_both_question_kinds_in_both_splits(rows):
    for split in SPLITS:
        assert {r["data_source"] for r in rows[split]} == SOURCES, split


def test_test_subjects_are_disjoint_from_train_subjects(rows):
    train = {r["extra_info"]["subject"] for r in rows["train"]}
    test = {r["extra_info"]["subject"] for r in rows["test"]}
    assert train and test and not train & test


# ---------------------------------------------------------------- file schemas


def test_parquet_schema_is_search_r1_format(synth_world, rows):
    for split in SPLITS:
        schema = pq.read_schema(synth_world / f"{split}.parquet")
        for col in ("data_source", "prompt", "ability", "reward_model", "extra_info", "id",
                    "question", "golden_answers"):
            assert col in schema.names, col
        assert schema.field("data_source").type == pa.string()
        prompt = schema.field("prompt").type
        assert pa.types.is_list(prompt) and pa.types.is_struct(prompt.value_type)
        assert {f.name for f in prompt.value_type} == {"role", "content"}
        rm = schema.field("reward_model").type
        target = rm.field("ground_truth").type.field("target").type
        assert pa.types.is_list(target) and target.value_type == pa.string()
        info = schema.field("extra_info").type
        assert info.field("split").type == pa.string() and pa.types.is_integer(info.field("index").type)

        for i, row in enumerate(rows[split]):
            assert row["data_source"] in SOURCES
            assert row["prompt"] == [{"role": "user", "content": make_prompt(row["question"])}]
            assert row["ability"] == "fact-reasoning"
            assert row["reward_model"] == {"style": "rule",
                                           "ground_truth": {"target": row["golden_answers"]}}
            assert row["golden_answers"] and all(isinstance(a, str) and a for a in row["golden_answers"])
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
    ids = [r["id"] for s in SPLITS for r in rows[s]]
    assert len(ids) == len(set(ids))


def test_jsonl_matches_parquet(synth_world, corpus, rows):
    for split in SPLITS:
        records = _jsonl(synth_world / f"{split}.jsonl")
        assert len(records) == len(rows[split])
        for rec, row in zip(records, rows[split]):
            assert set(rec) == {"id", "question", "golden_answers", "data_source", "gold_doc_ids"}
            assert isinstance(rec["id"], str) and isinstance(rec["question"], str)
            assert rec["id"] == row["id"] and rec["question"] == row["question"]
            assert rec["golden_answers"] == row["golden_answers"]
            assert rec["data_source"] == row["data_source"]
            assert rec["gold_doc_ids"] == row["extra_info"]["gold_doc_ids"]
            assert all(i in corpus for i in rec["gold_doc_ids"])


def test_parquet_loads_with_pandas_like_verl(synth_world):
    import pandas as pd

    df = pd.read_parquet(synth_world / "train.parquet")
    row = df.iloc[0]
    assert row["prompt"][0]["role"] == "user"
    assert list(row["reward_model"]["ground_truth"]["target"]) == list(row["golden_answers"])


# ---------------------------------------------------------------- arguments and CLI


@pytest.mark.parametrize("kwargs, key", [
    ({"n_entities": 5}, "n_entities"),
    ({"test_fraction": 1.0}, "test_fraction"),
    ({"max_train": -1}, "max_train"),
])
def test_bad_arguments_name_the_problem(tmp_path, kwargs, key):
    with pytest.raises(ValueError, match=key):
        generate_world(tmp_path, progress=False, **kwargs)


def test_caps_limit_question_counts(tmp_path):
    paths = generate_world(tmp_path, n_entities=60, max_train=10, max_test=3, progress=False)
    assert len(_jsonl(paths["train_jsonl"])) == 10
    assert len(_jsonl(paths["test_jsonl"])) == 3


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "search_r1.data.synth", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_help_explains_every_flag():
    res = _run_cli("--help")
    assert res.returncode == 0
    for flag in ("--out", "--seed", "--n-entities", "--test-fraction", "--max-train",
                 "--max-test", "--no-progress"):
        assert flag in res.stdout


def test_cli_generates_a_small_world(tmp_path, synth_world):
    res = _run_cli("--out", str(tmp_path), "--seed", str(SYNTH_WORLD_SEED),
                   "--n-entities", str(SYNTH_WORLD_ENTITIES))
    assert res.returncode == 0, res.stderr
    assert "passages" in res.stdout
    for name in FILES.values():
        assert (tmp_path / name).read_bytes() == (synth_world / name).read_bytes(), name


def test_cli_rejects_bad_size_without_traceback(tmp_path):
    res = _run_cli("--out", str(tmp_path), "--n-entities", "3")
    assert res.returncode == 2
    assert "n_entities" in res.stderr and "Traceback" not in res.stderr


def test_no_employer_question_for_founders():
    """A person who founded a company and also worked for another has two fair answers to "Which
    company did X work for?"; such questions are not asked."""
    import random

    from search_r1.data.passages import template_vocabulary
    from search_r1.data.questions import candidate_questions
    from search_r1.data.world import build_world

    w = build_world(400, random.Random(0), template_vocabulary())
    both = [e for e in w.entities if e.kind == "person" and e.founded and e.employer >= 0]
    only = [e for e in w.entities if e.kind == "person" and not e.founded and e.employer >= 0]
    assert both and only
    rng = random.Random(0)
    for e in both:
        assert not any(rel == "employer" for q in candidate_questions(e, w, rng) for _, rel in q.chain[:1])
    assert any(q.chain[0][1] == "employer" for e in only for q in candidate_questions(e, w, rng))
