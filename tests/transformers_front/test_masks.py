"""ripplekv_ext.transformers_front.masks: the per-row lengths of a left-padded batch's attention mask."""

import pytest
import torch

from ripplekv_ext.transformers_front.masks import row_lengths


def test_row_lengths():
    assert row_lengths(None) is None
    assert row_lengths(torch.ones(2, 5, dtype=torch.long)) is None
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    assert row_lengths(mask).tolist() == [2, 4, 1]
    assert row_lengths(mask.bool()).tolist() == [2, 4, 1]
    with pytest.raises(ValueError, match="must be a 2-D"):
        row_lengths(mask[None])
