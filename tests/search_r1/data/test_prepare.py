"""`python -m search_r1.data.prepare`: FlashRAG files -> Search-R1 parquet, bad rows, splits, readers."""
import json

import pandas as pd
import pytest

from search_r1.data.prepare import PrepareError, main, parse_spec, prepare
from search_r1.prompts import CHAT_SYSTEM_INSTRUCTION, TOOL_CALL_INSTRUCTION, make_prompt


def _jsonl(path, rows, raw_lines=()):
    with open(path, "wb") as f:
        for r in rows:
            f.write((json.dumps(r) + "\n").encode())
        for line in raw_lines:
            f.write(line)
    return path


def _qa(n, prefix="q"):
    return [{"id": f"{prefix}{i}", "question": f" who made thing {prefix}{i} ", "golden_answers": [f"ans {i}", f"alias {i}"]}
            for i in range(n)]


@pytest.fixture
def broken(tmp_path):
    """One jsonl with a row of every kind of problem (line numbers in the comments)."""
    rows = [
        {"id": "a", "question": "fine question", "golden_answers": ["x"]},  # 1 ok
        {"id": "b", "question": "   ", "golden_answers": ["x"]},  # 2 empty question
        {"id": "c", "question": "no answers", "golden_answers": []},  # 3 empty answers
        {"id": "a", "question": "same id again", "golden_answers": ["y"]},  # 4 duplicate of line 1
        {"question": "no id", "golden_answers": ["z"]},  # 5 missing id
    ]
    return _jsonl(tmp_path / "broken.jsonl", rows,
                  raw_lines=[b"{not json\n", b'{"id": "d", "question": "caf\xe9?", "golden_answers": ["e"]}\n',
                             b"\n", b'{"id": "e", "question": "last ok", "golden_answers": "single"}\n'])


def test_bad_rows_are_listed_with_file_and_line(broken, tmp_path, capsys):
    rc = main([f"src={broken}", "--out", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "6 bad row(s)" in err
    for line, what in [(2, "empty or non-text question"), (3, "golden_answers is empty"),
                       (4, "duplicate id 'a'"), (5, "missing ['id']"), (6, "not valid JSON"), (7, "not UTF-8")]:
        assert f"{broken}:{line}: {what}" in err
    assert f"first at {broken}:1" in err
    assert "--skip-bad" in err
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_skip_bad_drops_and_counts(broken, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([f"src={broken}", "--out", str(out), "--skip-bad", "--test-fraction", "0"]) == 0
    printed = capsys.readouterr()
    assert "| src | 8 | 6 | 2 | 0 |" in printed.out  # read 8 non-blank lines, 6 bad, 2 kept
    assert "dropped 6 bad row(s)" in printed.err
    df = pd.read_parquet(out / "train.parquet")
    assert sorted(df["id"]) == ["src:a", "src:e"]
    e = df[df["id"] == "src:e"].iloc[0]
    assert list(e["golden_answers"]) == ["single"]  # a bare string answer becomes a one-element list
    assert e["question"] == "last ok?"
    assert not (out / "test.parquet").exists()
    meta = json.loads((out / "prepare_meta.json").read_text())
    assert meta["counts"] == {"train": 2, "test": 0} and meta["dropped"] == {"src": 6}


def test_missing_column_fails_even_with_skip_bad(tmp_path):
    path = tmp_path / "x.parquet"
    pd.DataFrame({"id": ["1"], "query": ["q"], "golden_answers": [["a"]]}).to_parquet(path)
    with pytest.raises(PrepareError, match=r"missing column\(s\) \['question'\].*FlashRAG"):
        prepare([parse_spec(f"s={path}")], tmp_path / "out", skip_bad=True)


def test_spec_parsing_errors():
    assert parse_spec("nq:test=a/b.jsonl").split == "test"
    for bad, match in [("nq", "NAME=PATH"), ("n q=x.jsonl", "letters"), ("nq:dev=x.jsonl", "split 'dev'")]:
        with pytest.raises(PrepareError, match=match):
            parse_spec(bad)


def test_splits_counts_ids_index_and_seed(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _qa(20, "a"))
    b = tmp_path / "b.parquet"
    pd.DataFrame(_qa(10, "b")).to_parquet(b)
    c = tmp_path / "c.csv"
    c.write_text('id,question,golden_answers\n1,what is c one,"[""c1"", ""see one""]"\n2,what is c two,c2\n')
    specs = [parse_spec(s) for s in (f"nq={a}", f"hotpot={b}", f"csvq:test={c}")]
    res = prepare(specs, tmp_path / "out", test_fraction=0.25, max_per_source=8, seed=3)
    # nq: 20 -> cap 8 -> 2 test / 6 train; hotpot: 10 -> 8 -> 2 / 6; csvq pinned to test: 2
    assert res["counts"] == {"train": 12, "test": 6}
    assert "| nq | 20 | 0 | 6 | 2 |" in res["table"] and "| csvq | 2 | 0 | 0 | 2 |" in res["table"]
    train = pd.read_parquet(tmp_path / "out" / "train.parquet")
    test = pd.read_parquet(tmp_path / "out" / "test.parquet")
    ids = list(train["id"]) + list(test["id"])
    assert len(set(ids)) == len(ids) == 18
    for df, split in ((train, "train"), (test, "test")):
        for source, group in df.groupby("data_source", sort=False):
            idx = [e["index"] for e in group["extra_info"]]
            assert sorted(idx) == list(range(len(group)))  # per source and split, from 0
            assert all(e["split"] == split for e in group["extra_info"])
    csv_rows = test[test["data_source"] == "csvq"].sort_values("id")
    assert [list(g) for g in csv_rows["golden_answers"]] == [["c1", "see one"], ["c2"]]
    assert list(csv_rows["id"]) == ["csvq:1", "csvq:2"]
    row = train.iloc[0]
    assert row["agent_name"] == "search_r1" and row["ability"] == "fact-reasoning"
    assert list(row["reward_model"]["ground_truth"]["target"]) == list(row["golden_answers"])
    assert row["question"].endswith("?") and not row["question"].startswith(" ")
    assert row["prompt"][0]["content"] == make_prompt(row["question"])
    # the same seed gives the same files; another seed another order
    again = prepare(specs, tmp_path / "out2", test_fraction=0.25, max_per_source=8, seed=3)
    assert again["counts"] == res["counts"]
    assert list(pd.read_parquet(tmp_path / "out2" / "train.parquet")["id"]) == list(train["id"])
    prepare(specs, tmp_path / "out3", test_fraction=0.25, max_per_source=8, seed=4)
    assert list(pd.read_parquet(tmp_path / "out3" / "train.parquet")["id"]) != list(train["id"])


def test_templates(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _qa(2))
    prepare([parse_spec(f"s={a}")], tmp_path / "chat", template="chat", test_fraction=0)
    prompt = pd.read_parquet(tmp_path / "chat" / "train.parquet")["prompt"].iloc[0]
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert prompt[0]["content"] == CHAT_SYSTEM_INSTRUCTION and prompt[1]["content"].startswith("Question: who made")
    prepare([parse_spec(f"s={a}")], tmp_path / "tool", template="tool_call", test_fraction=0)
    row = pd.read_parquet(tmp_path / "tool" / "train.parquet").iloc[0]
    assert row["prompt"][0]["content"] == TOOL_CALL_INSTRUCTION.format(question=row["question"])
    assert row["extra_info"]["template"] == "tool_call"


def test_round_trip_our_dataset_and_verls_rlhf_dataset(tmp_path):
    """Both readers take the prepared file: our PromptDataset and verl's real RLHFDataset."""
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from search_r1.data.dataset import PromptDataset
    from search_r1.models import load_tokenizer
    from search_r1.prompts import apply_chat_template

    a = _jsonl(tmp_path / "a.jsonl", _qa(6, "a"))
    b = _jsonl(tmp_path / "b.jsonl", _qa(4, "b"))
    prepare([parse_spec(f"nq={a}"), parse_spec(f"hotpot={b}")], tmp_path / "out", template="chat", test_fraction=0.5)
    path = str(tmp_path / "out" / "test.parquet")
    frame = pd.read_parquet(path)
    tok = load_tokenizer("smollm2-135m-instruct")

    ours = PromptDataset([path], tok, max_prompt_length=512)
    assert len(ours) == 5
    for rec, (_, row) in zip(ours.records, frame.iterrows()):
        assert rec.data_source == row["data_source"] and rec.question == row["question"]
        assert list(rec.golden_answers) == list(row["golden_answers"])
        assert list(rec.input_ids) == apply_chat_template(tok, [dict(m) for m in row["prompt"]])

    config = OmegaConf.create({"max_prompt_length": 512, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp_path / "verl_cache")})
    verl_ds = RLHFDataset(path, tok, config)
    assert len(verl_ds) == 5
    for i, (_, row) in enumerate(frame.iterrows()):
        item = verl_ds[i]
        assert item["raw_prompt"] == [dict(m) for m in row["prompt"]]
        assert item["agent_name"] == "search_r1"
        assert item["data_source"] == row["data_source"]
        assert item["index"] == row["extra_info"]["index"]
        assert item["reward_model"]["ground_truth"]["target"] == list(row["golden_answers"])
