"""``to_device_many``: several host lists in one copy per dtype, handed back as views in order."""

from __future__ import annotations

import torch

from deepinfer.model.transfer import to_device_many


def test_lists_of_each_dtype_come_back_as_their_own_tensors_in_order() -> None:
    items = [([3, 1, 4], torch.int64), ([0.5, 2.0], torch.float32), ([], torch.int64),
             ([[1, 2], [3, 4], [5, 6]], torch.int64), ([7.25], torch.float32), ([9], torch.int64)]
    out = to_device_many(items, torch.device("cpu"))
    assert len(out) == len(items)
    for tensor, (values, dtype) in zip(out, items, strict=True):
        assert tensor.dtype == dtype
        assert torch.equal(tensor, torch.tensor(values, dtype=dtype))
    assert out[3].shape == (3, 2)
    out[0][0] = -1  # views of one buffer, each its own slice
    assert out[2].numel() == 0 and out[3][0, 0] == 1 and out[5][0] == 9
