"""search_r1.data.splits: a seeded, disjoint, balanced dev split carved from the training questions."""
import pandas as pd
import pytest

from search_r1.data.splits import carve_dev, main, weighted_sources


def test_dev_is_disjoint_balanced_interleaved_and_stable(synth_world, tmp_path):
    train = synth_world / "train.parquet"
    rest, dev = carve_dev(train, tmp_path / "split", per_source=10, seed=3)
    whole, r, d = pd.read_parquet(train), pd.read_parquet(rest), pd.read_parquet(dev)
    assert sorted(r["id"].tolist() + d["id"].tolist()) == sorted(whole["id"])  # every row once
    assert d["data_source"].value_counts().to_dict() == {s: 10 for s in whole["data_source"].unique()}
    first = d["data_source"].head(4).tolist()
    assert first[0] != first[1] and first[2] != first[3]  # interleaved: a prefix is balanced
    stamp = dev.stat().st_mtime_ns
    assert carve_dev(train, tmp_path / "split", per_source=10, seed=3) == (rest, dev)
    assert dev.stat().st_mtime_ns == stamp  # same inputs: nothing rewritten
    other = pd.read_parquet(carve_dev(train, tmp_path / "other", per_source=10, seed=4)[1])
    assert set(other["id"]) != set(d["id"])


def test_too_few_rows_fail_naming_the_fix(synth_world, tmp_path, capsys):
    with pytest.raises(ValueError, match="lower --per-source"):
        carve_dev(synth_world / "train.parquet", tmp_path, per_source=10**6)
    assert main(["--train", str(synth_world / "train.parquet"), "--out", str(tmp_path), "--per-source", "0"]) == 2
    assert ">= 1" in capsys.readouterr().err


def test_sources_keep_only_the_named_data_sources(synth_world, tmp_path, capsys):
    train = synth_world / "train.parquet"
    rest, dev = carve_dev(train, tmp_path / "nq", per_source=10, sources=["synth_nq"])
    whole, r, d = pd.read_parquet(train), pd.read_parquet(rest), pd.read_parquet(dev)
    assert set(r["data_source"]) == set(d["data_source"]) == {"synth_nq"}
    assert len(r) + len(d) == int((whole["data_source"] == "synth_nq").sum())
    # a split of all sources in the same directory is carved again, not reused
    _, dev_all = carve_dev(train, tmp_path / "nq", per_source=10)
    assert set(pd.read_parquet(dev_all)["data_source"]) == set(whole["data_source"])
    assert main(["--train", str(train), "--out", str(tmp_path / "x"), "--sources", "synth_typo"]) == 2
    assert "synth_typo" in capsys.readouterr().err


def test_weighted_sources_repeat_each_source_by_its_weight(synth_world):
    whole = pd.read_parquet(synth_world / "train.parquet")
    counts = whole["data_source"].value_counts().to_dict()
    mixed = weighted_sources(whole, ["synth_hotpotqa:3", "synth_nq"], "train.parquet")
    assert mixed["data_source"].value_counts().to_dict() == {"synth_hotpotqa": 3 * counts["synth_hotpotqa"],
                                                             "synth_nq": counts["synth_nq"]}
    # every two-hop question three times, none lost or invented
    two = mixed[mixed["data_source"] == "synth_hotpotqa"]["id"].value_counts()
    assert set(two) == {3} and set(two.index) == set(whole[whole["data_source"] == "synth_hotpotqa"]["id"])
    only = weighted_sources(whole, ["synth_nq"], "train.parquet")
    assert set(only["data_source"]) == {"synth_nq"} and len(only) == counts["synth_nq"]
    for bad in (["synth_nq:0"], ["synth_nq:x"], [":2"], ["synth_nq", "synth_nq:2"]):
        with pytest.raises(ValueError, match="source:weight"):
            weighted_sources(whole, bad, "train.parquet")
    with pytest.raises(ValueError, match="synth_typo"):
        weighted_sources(whole, ["synth_typo:2"], "train.parquet")
