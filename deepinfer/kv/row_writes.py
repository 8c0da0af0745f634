"""Row writes into cache tensors that stay in place inside compiled layers.

A decoder layer that writes its own cache rows (DeepSeek-V4's compressors: their rings and paged entries)
mutates a view of a cache pool. Traced by ``torch.compile`` (``kernels.compile: inductor``), a plain
``index_copy_`` on such a view is functionalized into a new copy of the whole tensor plus a copy back:
on the H200 two full passes over each part every step (5.2 of a V4-shaped batch-1 step's 9.3 ms).
``write_rows`` goes through the custom op ``deepinfer::write_rows``, which declares the mutation, while
compiling: Inductor then calls it in place like any extern kernel. Eager callers skip the dispatcher.
"""

from __future__ import annotations

import torch


def _write(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dim() == 2:
        dst.index_copy_(0, rows, src)
        return
    per_block = dst.shape[1]
    if dst.stride(0) == per_block * dst.stride(1):  # the two leading dimensions flatten into one
        dst.view(-1, dst.shape[-1]).index_copy_(0, rows, src)
    else:
        dst[rows // per_block, rows % per_block] = src


@torch.library.custom_op("deepinfer::write_rows", mutates_args=("dst",))
def _write_rows_op(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    _write(dst, rows, src)


def write_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src [n, W]`` at rows ``rows [n]`` (int64) of ``dst``: ``[N, W]``, or ``[A, B, W]`` with row
    ``a·B + b`` (any strides). Duplicate rows keep one of their values, unspecified which.

    ``dst`` must be a tensor the caller was given (a bound cache part), never a view made by the same
    compiled code (``part[slot]``): with torch 2.13 a custom op's write into a view made inside the traced
    graph is lost (the compiled function returns, the part is unchanged)."""
    if torch.compiler.is_compiling():
        torch.ops.deepinfer.write_rows(dst, rows, src)
    else:
        _write(dst, rows, src)
