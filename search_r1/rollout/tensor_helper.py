"""Padding, unpadding and position-id helpers between ragged token lists and batch tensors, and
the grouping of rows that share a prompt.

Layout conventions (verl's): prompts are left-padded, responses right-padded, so every row's prompt
ends at the same column and its response starts at the next one. Positions count real tokens only.
The ragged -> dense fills use one numpy scatter per batch, never a Python loop over tokens.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """(B, L) left-padded ids + mask -> B lists of the real tokens.

    A left-padded row keeps its real tokens as a suffix, so each row is one slice.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must have the same shape")
    lengths = attention_mask.sum(dim=-1).tolist()  # (B,)
    width = input_ids.shape[-1]
    ids = input_ids.tolist()
    mask = attention_mask.tolist()
    rows = []
    for row, m, n in zip(ids, mask, lengths):
        n = int(n)
        if n and (m[width - n] != 1 or m[-1] != 1):
            raise ValueError("gen_batch rows must be left-padded (attention_mask ones at the right end); "
                             "pad the prompts on the left as verl does")
        rows.append(row[width - n:] if n else [])
    return rows


def pad_ragged(rows: list[list], width: int | None = None, pad_value=0, left: bool = False,
               dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lists -> (values (B, W), mask (B, W)), padded on the right (or left).

    W = `width` or the longest row (at least 1, so an all-empty batch still has a column).
    Rows longer than W raise: silently cutting tokens would corrupt the layout.
    """
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))  # (B,)
    longest = int(lengths.max()) if len(rows) else 0
    width = max(1, longest) if width is None else width
    if longest > width:
        raise ValueError(f"a row has {longest} items but the padded width is {width}")
    cols = np.arange(width)[None, :]  # (1, W)
    mask = cols >= (width - lengths)[:, None] if left else cols < lengths[:, None]  # (B, W)
    values = np.full((len(rows), width), pad_value, dtype=dtype)
    if longest:
        # Row-major order of the True cells equals the concatenation of the rows.
        values[mask] = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lengths.sum()))
    return values, mask.astype(np.int64)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) mask -> (B, L) positions: clip(cumsum(mask) - 1, min=0), verl's convention.

    Left padding gets 0; right padding repeats the last real position (never read: masked out).
    """
    return torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


def shared_prompt_rows(ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with the same prompt (ids, mask and positions of the prompt columns, all (m, p)).

    Returns (first, inverse): `first` (u,) one row index per distinct prompt, `inverse` (m,) the
    position in `first` of each row's prompt, so rows == first[inverse] prompt-wise. A GRPO batch
    repeats each prompt rollout.n times; the sampler's prefill and the trainer's log-prob passes
    run each distinct prompt once and repeat its KV-cache rows with `inverse`.
    """
    live = attn.bool()
    key = torch.cat([ids.masked_fill(~live, -1), pos.masked_fill(~live, -1)], dim=1)  # padding ids do not matter
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(len(inverse), device=ids.device), reduce="amin")
    return first, inverse
