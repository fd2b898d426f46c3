"""Prompt dataset and a resumable data loader for the trainer.

`PromptDataset` reads Search-R1 format parquet files (columns `data_source`, `prompt` chat messages,
`ability`, `reward_model.ground_truth.target`, `extra_info.index`), applies the chat template once at
load time and gives every row a `uid` that is unique across all the files loaded together.
`extra_info.index` is *not* a uid: it restarts at 0 in every dataset, so grouping GRPO samples by it
mixes different questions once two datasets are merged (an upstream defect).

`PromptDataLoader` yields `verl.DataProto` batches with left-padded `input_ids`, `attention_mask`
and `position_ids`, plus object arrays `uid`, `data_source`, `golden_answers`, `question`, `index`,
`ability`, `reward_model` (the dict verl-style reward managers read). Its order is a pure function of
(seed, epoch), and its state is (seed, epoch, position), so a resumed run sees exactly the batches
it would have seen.
"""
from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from verl import DataProto

from tqdm import tqdm

from search_r1.data.rows import parse_messages, parse_targets, read_frame, recover_question, schema_error
from search_r1.prompts import TEMPLATES, apply_chat_template

logger = logging.getLogger(__name__)

OVERLONG_MODES = ("error", "skip")
STATE_VERSION = 1
PROGRESS_MIN_ROWS = 2000  # show a tokenization progress bar for files at least this long


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, tokenized once at load time."""

    uid: str
    input_ids: tuple[int, ...]
    data_source: str
    golden_answers: tuple[str, ...]
    question: str | None
    index: int | None
    ability: str | None


def _file_tags(paths: Sequence[Path]) -> list[str]:
    """Short per-file uid prefixes: the file stem, qualified by the parent dir or position if needed."""
    stems = [p.stem for p in paths]
    tags = []
    for i, p in enumerate(paths):
        if stems.count(p.stem) == 1:
            tags.append(p.stem)
        else:
            tags.append(f"{p.parent.name}/{p.stem}#{i}")
    return tags


class PromptDataset:
    """Search-R1 parquet prompts, chat template applied, one unique `uid` per row.

    Args:
        parquet_paths: one path or a list; rows keep file order then row order.
        tokenizer: a Hugging Face tokenizer (its chat template is applied once per row).
        max_prompt_length: the longest prompt, in tokens, the rollout accepts.
        protocol: the prompt protocol the data was built for ("tags" or "tool_call"); used to check
            the name and to recover the raw question text from the instruction.
        on_overlong: "error" raises on the first too-long prompt; "skip" drops them and counts them
            in `num_skipped`.

    uids are `"{file_tag}:{row}"` (file_tag = file stem, qualified when two files share a stem), so
    they are stable across runs that load the same files in the same order.
    """

    def __init__(self, parquet_paths, tokenizer, max_prompt_length: int, protocol: str = "tags",
                 on_overlong: str = "error"):
        if protocol not in TEMPLATES:
            raise ValueError(f"protocol={protocol!r} is unknown; choose one of {sorted(TEMPLATES)}")
        if on_overlong not in OVERLONG_MODES:
            raise ValueError(f"on_overlong={on_overlong!r} is unknown; choose one of {list(OVERLONG_MODES)}")
        if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
        if isinstance(parquet_paths, (str, Path)):
            parquet_paths = [parquet_paths]
        self.paths = [Path(p) for p in parquet_paths]
        if not self.paths:
            raise ValueError("parquet_paths is empty; pass at least one Search-R1 parquet file")
        for p in self.paths:
            if not p.is_file():
                raise FileNotFoundError(
                    f"dataset file {p} does not exist; generate the synthetic world with "
                    f"`python -m search_r1.data.synth --out DIR` or fix the data path")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.protocol = protocol
        self.on_overlong = on_overlong
        self.pad_token_id = _pad_id(tokenizer)
        self.num_skipped = 0
        self.records: list[PromptRecord] = []
        for path, tag in zip(self.paths, _file_tags(self.paths)):
            self._load_file(path, tag)
        if not self.records:
            raise ValueError(
                f"no usable prompts in {[str(p) for p in self.paths]} ({self.num_skipped} longer than "
                f"max_prompt_length={max_prompt_length}); raise max_prompt_length")
        if self.num_skipped:
            logger.warning("skipped %d prompts longer than max_prompt_length=%d (kept %d)",
                           self.num_skipped, max_prompt_length, len(self.records))
        uids = [r.uid for r in self.records]
        if len(set(uids)) != len(uids):  # cannot happen with distinct tags; guards future edits
            raise RuntimeError("duplicate uids in PromptDataset")
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        """Short hash of (uid, token ids) of every row: a resumed loader checks it sees the same data."""
        h = hashlib.sha1()
        for r in self.records:
            h.update(r.uid.encode())
            h.update(np.asarray(r.input_ids, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def _load_file(self, path: Path, tag: str) -> None:
        rows = read_frame(path).to_dict(orient="records")
        for row, values in enumerate(tqdm(rows, desc=f"tokenizing {path.name}", unit="prompt",
                                          disable=len(rows) < PROGRESS_MIN_ROWS)):
            messages = parse_messages(values["prompt"], path, row)
            targets = parse_targets(values["reward_model"], path, row)
            data_source = values["data_source"]
            if not isinstance(data_source, str) or not data_source:
                raise schema_error(path, row, "data_source", f"is {data_source!r}, not a non-empty string")
            ids = apply_chat_template(self.tokenizer, messages)
            if len(ids) > self.max_prompt_length:
                if self.on_overlong == "error":
                    raise ValueError(
                        f"{path} row {row}: prompt has {len(ids)} tokens > max_prompt_length="
                        f"{self.max_prompt_length}; raise max_prompt_length or set on_overlong='skip'")
                self.num_skipped += 1
                continue
            extra = values.get("extra_info")
            index = extra.get("index") if isinstance(extra, dict) else None
            ability = values.get("ability")
            self.records.append(PromptRecord(
                uid=f"{tag}:{row}",
                input_ids=tuple(int(i) for i in ids),
                data_source=data_source,
                golden_answers=tuple(targets),
                question=recover_question(values, messages),
                index=None if index is None else int(index),
                ability=ability if isinstance(ability, str) else None,
            ))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def collate(self, indices: Sequence[int], pad_to: int | None = None) -> DataProto:
        return collate_records([self.records[i] for i in indices], self.pad_token_id, pad_to)


def _pad_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id; set tokenizer.pad_token")


def _object_array(values: list) -> np.ndarray:
    """A 1-D object array even when every element is an equal-length list (np.array would go 2-D)."""
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def collate_records(records: Sequence[PromptRecord], pad_token_id: int, pad_to: int | None = None) -> DataProto:
    """Left-pad prompts into a DataProto.

    Tensors (B = len(records), L = longest prompt, or `pad_to`):
        input_ids (B, L) long, pad_token_id on the left;
        attention_mask (B, L) long, 0 on padding;
        position_ids (B, L) long, clip(cumsum(attention_mask) - 1, min=0) as in verl.
    """
    if not records:
        raise ValueError("cannot collate an empty batch")
    longest = max(len(r.input_ids) for r in records)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt in the batch ({longest})")
    input_ids = torch.full((len(records), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(records), width), dtype=torch.long)
    for i, r in enumerate(records):
        n = len(r.input_ids)
        input_ids[i, width - n:] = torch.tensor(r.input_ids, dtype=torch.long)
        attention_mask[i, width - n:] = 1
    position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)  # (B, L)
    non_tensors = {
        "uid": _object_array([r.uid for r in records]),
        "data_source": _object_array([r.data_source for r in records]),
        "golden_answers": _object_array([list(r.golden_answers) for r in records]),
        "question": _object_array([r.question for r in records]),
        "index": _object_array([r.index for r in records]),
        "ability": _object_array([r.ability for r in records]),
        "reward_model": _object_array([{"style": "rule", "ground_truth": {"target": list(r.golden_answers)}}
                                       for r in records]),
    }
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors=non_tensors,
    )


def repeat_interleave(batch: DataProto, n: int) -> DataProto:
    """Each row repeated `n` times in place ([a, b] -> [a, a, b, b]), non-tensors included.

    A thin check around verl's `DataProto.repeat(interleave=True)`, which already handles object
    arrays of lists (golden_answers) with np.repeat along axis 0.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repeat count n must be a positive int, got {n!r}")
    return batch.repeat(repeat_times=n, interleave=True)


class PromptDataLoader:
    """Seeded, resumable batches of a PromptDataset.

    The order of epoch `e` is `default_rng([seed, e]).permutation(N)` (or 0..N-1 without shuffle), so
    it depends on nothing but (seed, epoch). `position` counts the batches already handed out in the
    current epoch; it advances *before* a batch is returned, so `state_dict()` taken after receiving a
    batch resumes with the next one. Iterating the loader yields the rest of the current epoch; a
    finished epoch rolls over to the next one lazily when more batches are asked for.

    `next_batch()` crosses epochs without end (for step-based training); `iterate_once()` is a plain
    ordered pass for validation that keeps the last partial batch and leaves the state alone.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, pad_to: int | None = None):
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if drop_last and batch_size > len(dataset):
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts) and "
                f"drop_last=True leaves no batch; lower the batch size or set drop_last=False")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pad_to = pad_to
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _batch_at(self, epoch: int, position: int) -> DataProto:
        order = self.epoch_order(epoch)
        idx = order[position * self.batch_size: (position + 1) * self.batch_size]
        batch = self.dataset.collate(idx.tolist(), self.pad_to)
        batch.meta_info.update({"epoch": epoch, "batch_in_epoch": position})
        return batch

    def next_batch(self) -> DataProto:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        epoch, position = self.epoch, self.position
        self.position += 1
        return self._batch_at(epoch, position)

    def __iter__(self) -> Iterator[DataProto]:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        epoch = self.epoch
        while self.epoch == epoch and self.position < len(self):
            yield self.next_batch()

    def iterate_once(self, batch_size: int | None = None) -> Iterator[DataProto]:
        """All rows once, in file order, last partial batch included; loader state untouched."""
        bs = batch_size or self.batch_size
        if bs <= 0:
            raise ValueError(f"batch_size must be positive, got {bs}")
        n = len(self.dataset)
        for start in range(0, n, bs):
            yield self.dataset.collate(list(range(start, min(start + bs, n))), self.pad_to)

    def state_dict(self) -> dict:
        """JSON-serialisable state: enough to replay the exact batch sequence."""
        return {"version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "position": self.position,
                "batch_size": self.batch_size, "num_rows": len(self.dataset), "shuffle": self.shuffle,
                "drop_last": self.drop_last, "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Restore (seed, epoch, position).

        With `strict` (default) the batch settings and the data fingerprint must match the saved ones;
        `strict=False` accepts changed data (e.g. a fixed typo) with a warning, batch settings must
        still match because they define the batch boundaries.
        """
        for key in ("seed", "epoch", "position"):
            if key not in state:
                raise ValueError(f"data-loader state lacks {key!r} (got keys {sorted(state)})")
        # These fix the batch boundaries; a mismatch means the resumed run would see other batches.
        for key, mine in (("batch_size", self.batch_size), ("num_rows", len(self.dataset)),
                          ("shuffle", self.shuffle), ("drop_last", self.drop_last)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"data-loader state has {key}={state[key]!r} but this loader has {key}={mine!r}; "
                    f"resume with the same data files and batch settings, or start a fresh run")
        saved = state.get("fingerprint")
        if saved is not None and saved != self.dataset.fingerprint:
            msg = (f"data-loader state was saved for data with fingerprint {saved} but the loaded data has "
                   f"{self.dataset.fingerprint} (files or prompts changed)")
            if strict:
                raise ValueError(msg + "; load the same data files, or pass strict=False to resume anyway")
            logger.warning("%s; resuming anyway (strict=False)", msg)
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
