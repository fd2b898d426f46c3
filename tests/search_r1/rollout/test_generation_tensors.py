"""tensor_helper: ragged <-> padded conversions and positions, checked against hand-built tensors."""
import numpy as np
import pytest
import torch

from search_r1.rollout.tensor_helper import pad_ragged, position_ids_from_mask, strip_left_padding


def test_pad_ragged_right_and_left():
    vals, mask = pad_ragged([[1, 2, 3], [4], []], pad_value=9)
    assert vals.tolist() == [[1, 2, 3], [4, 9, 9], [9, 9, 9]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    vals, mask = pad_ragged([[1, 2, 3], [4]], pad_value=0, left=True, width=4)
    assert vals.tolist() == [[0, 1, 2, 3], [0, 0, 0, 4]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    vals, _ = pad_ragged([[0.5], [-1.25, 2.0]], pad_value=0.0, dtype="float32")
    assert vals.dtype == np.float32 and vals.tolist() == [[0.5, 0.0], [-1.25, 2.0]]
    # an all-empty batch still has one (padding) column
    assert pad_ragged([[], []])[0].shape == (2, 1)
    with pytest.raises(ValueError, match="has 3 items but the padded width is 2"):
        pad_ragged([[1, 2, 3]], width=2)


def test_strip_left_padding_roundtrip_and_rejects_right_padding():
    rows = [[5, 6, 7], [8], []]
    ids, mask = (torch.from_numpy(a) for a in pad_ragged(rows, left=True))
    assert strip_left_padding(ids, mask) == rows
    right_ids, right_mask = (torch.from_numpy(a) for a in pad_ragged(rows))
    with pytest.raises(ValueError, match="left-padded"):
        strip_left_padding(right_ids, right_mask)
    with pytest.raises(ValueError, match="same shape"):
        strip_left_padding(ids, mask[:, :1])


def test_position_ids_follow_verl():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    # left pads 0, real tokens 0.., right pads repeat the last position
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]
    from verl.utils.model import compute_position_id_with_mask
    assert torch.equal(position_ids_from_mask(mask), compute_position_id_with_mask(mask))
