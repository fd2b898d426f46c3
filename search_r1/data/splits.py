"""A dev split carved from the training questions, for choosing a recipe without touching the test split.

    python -m search_r1.data.splits --train data/world/train.parquet --per-source 100 --out data/world_dev
    -> data/world_dev/train.parquet (the training questions minus dev) and data/world_dev/dev.parquet

`--sources synth_nq` keeps only the listed data_sources in both outputs (the demo trains and validates
on single-hop questions). Dev rows are `per_source` rows of every data_source, drawn with a seeded shuffle and interleaved by
source, so a recipe chosen on dev (or on its first N rows) is judged on a balanced mix of single- and
two-hop questions. The two outputs are
disjoint and together hold every training row once. Re-running with the same inputs rewrites nothing
(a `split.json` records the source file's size and mtime and the settings); both files are written to
temporary names and renamed into place.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

META = "split.json"
FORMAT_VERSION = 2  # bumped when the draw or the row order changes, so older splits are carved again


def keep_sources(frame, sources: list[str], name) -> "pandas.DataFrame":
    """The rows of `frame` whose data_source is in `sources`; ValueError naming any source the file
    (`name`, for the message) does not have."""
    unknown = sorted(set(sources) - set(frame["data_source"]))
    if unknown:
        raise ValueError(f"--sources {unknown} not in {name} (its data_sources: "
                         f"{sorted(frame['data_source'].unique())}). Fix: name sources the file has")
    return frame[frame["data_source"].isin(sources)]


def weighted_sources(frame, spec: list[str], name) -> "pandas.DataFrame":
    """The rows of the data_sources `spec` names, each repeated by its weight: "src" (weight 1) or
    "src:w" (an integer w >= 1), e.g. ["synth_hotpotqa:3", "synth_nq"] gives three copies of every
    two-hop row and one of every single-hop row, so a shuffled epoch samples two-hop prompts three
    times as often per question. ValueError for a malformed entry or a source the file lacks."""
    import pandas as pd

    weights: dict[str, int] = {}
    for entry in spec:
        source, _, w = entry.partition(":")
        if not source or (w and not (w.isdigit() and int(w) >= 1)) or source in weights:
            raise ValueError(f"{entry!r}: expected a data_source named once, optionally with an integer "
                             f"weight >= 1 (e.g. synth_hotpotqa:3). Fix: write source or source:weight")
        weights[source] = int(w or 1)
    keep = keep_sources(frame, list(weights), name)
    parts = [keep[keep["data_source"] == source] for source, w in weights.items() for _ in range(w)]
    return pd.concat(parts, ignore_index=True)


def carve_dev(train_file, out_dir, per_source: int, seed: int = 0,
              sources: list[str] | None = None) -> tuple[Path, Path]:
    """(rest of train, dev) parquet paths under `out_dir`; see the module docstring.

    Raises ValueError when a data_source has fewer than `per_source` + 1 rows (training would lose
    it entirely), per_source < 1, or a name in `sources` is not a data_source of the file.
    """
    import pandas as pd

    train_file, out = Path(train_file), Path(out_dir)
    if per_source < 1:
        raise ValueError(f"--per-source {per_source}: allowed >= 1")
    stat = train_file.stat()
    meta = {"version": FORMAT_VERSION, "source": str(train_file.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "per_source": per_source, "seed": seed, "sources": sorted(sources) if sources else None}
    rest_path, dev_path = out / "train.parquet", out / "dev.parquet"
    try:
        if json.loads((out / META).read_text()) == meta and rest_path.is_file() and dev_path.is_file():
            return rest_path, dev_path
    except (OSError, ValueError):
        pass
    frame = pd.read_parquet(train_file)
    if sources:
        frame = keep_sources(frame, sources, train_file)
    counts = frame["data_source"].value_counts()
    short = {s: int(n) for s, n in counts.items() if n <= per_source}
    if short:
        raise ValueError(f"data_source(s) {short} have no more than --per-source={per_source} rows, so training "
                         f"would lose them. Fix: lower --per-source")
    shuffled = frame.sample(frac=1.0, random_state=seed)
    picked = shuffled.groupby("data_source", sort=True).head(per_source)
    # Sources interleaved (a, b, a, b, ...), so any prefix of dev (data.val_size=N) is balanced too.
    rank = picked.groupby("data_source", sort=True).cumcount()
    dev = picked.assign(_rank=rank.values).sort_values(["_rank", "data_source"], kind="stable").drop(columns="_rank")
    rest = frame.drop(index=picked.index)
    out.mkdir(parents=True, exist_ok=True)
    for part, path in ((rest, rest_path), (dev, dev_path)):
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        part.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    return rest_path, dev_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="training parquet file to carve the dev split from")
    p.add_argument("--out", required=True, help="output directory: train.parquet (the rest) and dev.parquet")
    p.add_argument("--per-source", type=int, default=100, help="dev questions per data_source (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (default: 0)")
    p.add_argument("--sources", nargs="+", default=None,
                   help="keep only these data_sources in both outputs (default: all), e.g. synth_nq")
    args = p.parse_args(argv)
    try:
        rest, dev = carve_dev(args.train, args.out, args.per_source, args.seed, args.sources)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"train: {rest}\ndev:   {dev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
