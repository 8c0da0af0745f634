"""DeepSeek-V4/V4.1 caches kept in V4.1's quantized KV layouts (``cache.kv_dtype`` ``fp8`` or ``fp4``): which
layout each cache part takes, and the plain-torch writes and reads the compressors, the indexer and the
reference attention go through (``kv/v41_formats.py`` defines the bytes; reference/deepinfer.md §3).

Which layout (the reference's choices, ``KVCacheManager.process``):

- paged compressed entries (main KV): ``FP4_MAIN`` under ``fp4`` (``use_fp4_sparse_kv: true``, V4.1's default),
  ``MXFP8`` under ``fp8``;
- the sliding-window ring of each layer (SWA KV, in the request's state slot): ``MXFP8`` under both;
- V4.1's indexer keys (``CompressedPart(index=True)``, the reference's ``ica_cache``): ``FP4_INDEX`` under both;
- the compressors' rings of raw projections stay in the model dtype (the reference keeps them in fp32), and so
  does everything under ``auto`` (or ``bf16`` on a bf16 model).

DeepSeek-V4 (not V4.1) takes ``fp8`` through the same path: its entries, its indexer's keys (its own
compressor's entries, so main-KV parts here) and its rings in ``MXFP8``.

Storage: a quantized part is a ``uint8`` tensor whose last dimension is the layout's bytes per token —
``[num_blocks, entries_per_block, bytes]`` paged, ``[slots, ring_size, bytes]`` for a ring. Interleaved layouts
hold one ``[data | scales]`` record per row. ``FP4_INDEX`` lays each block out in block-wide sections (every
entry's data, then every entry's scales), so its rows are nominal and it is read whole blocks at a time. No block
is padded to 32 bytes as the reference pads regions; at the reference's sizes none needs it (128 or 64 records
of 528, 288 or 68 bytes are multiples of 32). A reader tells a part's layout from its dtype and the width it
expects (``format_of``): ``uint8`` is quantized, and the three layouts' bytes per token differ at any width
(``w + w/32``, ``9w/16``, ``17w/32``).

Writes quantize with the layout's writer (``V41KVFormat.encode``) and reads dequantize with its reader
(``decode``) to float32; a prefill step attends to its own window keys as they read back from the ring
(``roundtrip``), so decode later reads the values prefill saw (the reference's ``cast_back``).
"""

from __future__ import annotations

import torch

from deepinfer.kv.fp8 import FP4_KV_DTYPE, FP8_DTYPE
from deepinfer.kv.memory import cache_zeros
from deepinfer.kv.row_writes import write_rows
from deepinfer.kv.v41_formats import FP4_INDEX, FP4_MAIN, MXFP8, V41KVFormat

_LAYOUTS = (MXFP8, FP4_MAIN, FP4_INDEX)


def entry_format(kv_dtype: torch.dtype, width: int, index: bool = False) -> V41KVFormat | None:
    """The layout of a paged part of ``width`` values a token under KV storage dtype ``kv_dtype``
    (``kv/fp8.kv_storage_dtype``); ``index``: V4.1's indexer keys. None: stored in ``kv_dtype`` itself."""
    if kv_dtype not in (FP8_DTYPE, FP4_KV_DTYPE):
        return None
    if index:
        return FP4_INDEX.at(width)
    return (MXFP8 if kv_dtype == FP8_DTYPE else FP4_MAIN).at(width)


def ring_format(kv_dtype: torch.dtype, width: int) -> V41KVFormat | None:
    """The layout of a sliding-window ring: MXFP8 under ``fp8`` and ``fp4`` (the reference's SWA is always
    MXFP8), else None (the model dtype)."""
    return MXFP8.at(width) if kv_dtype in (FP8_DTYPE, FP4_KV_DTYPE) else None


def row_bytes(fmt: V41KVFormat | None, width: int, dtype: torch.dtype) -> int:
    """Bytes one row of ``width`` values takes: the layout's bytes per token, or ``width`` of ``dtype``."""
    return width * dtype.itemsize if fmt is None else fmt.bytes_per_token


def allocate(leading: tuple[int, ...], width: int, fmt: V41KVFormat | None, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """Zeros ``[*leading, width]`` in ``dtype``, or ``[*leading, bytes_per_token]`` uint8 in layout ``fmt``."""
    if fmt is None:
        return cache_zeros((*leading, width), dtype, device)
    return cache_zeros((*leading, fmt.bytes_per_token), torch.uint8, device)


def format_of(cache: torch.Tensor, width: int) -> V41KVFormat | None:
    """The layout of a cache part that holds ``width`` values a token: None for a tensor in a float dtype."""
    if cache.dtype != torch.uint8:
        return None
    for fmt in _LAYOUTS:
        if width % fmt.per_scale == 0 and fmt.at(width).bytes_per_token == cache.shape[-1]:
            return fmt.at(width)
    raise ValueError(f"a uint8 cache part of {cache.shape[-1]} bytes a row holds none of V4.1's KV layouts "
                     f"at {width} values a token")


def _sections(cache: torch.Tensor, fmt: V41KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``[blocks, n, data_bytes]`` and ``[blocks, n, scale_bytes]`` of a block-wide layout's blocks."""
    blocks, n = cache.shape[0], cache.shape[1]
    flat = cache.view(blocks, n * cache.shape[2])
    split = n * fmt.data_bytes
    return flat[:, :split].unflatten(1, (n, fmt.data_bytes)), flat[:, split:].unflatten(1, (n, fmt.scale_bytes))


def write(cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x [n, width]`` at flat rows ``rows [n]`` (int64; row ``a·B + b`` of ``cache [A, B, ·]``),
    encoded in the part's layout or cast to its dtype."""
    width = x.shape[-1]
    fmt = format_of(cache, width)
    if fmt is None:
        write_rows(cache, rows, x.to(cache.dtype))
        return
    data, scales = fmt.encode(x)
    if fmt.interleaved:
        write_rows(cache, rows, torch.cat([data, scales], dim=-1))
        return
    # Sections are views made here, which ``write_rows`` must not be given (its docstring); compiled layers
    # copy the part for these writes.
    per_block = cache.shape[1]
    data_part, scale_part = _sections(cache, fmt)
    data_part[rows // per_block, rows % per_block] = data
    scale_part[rows // per_block, rows % per_block] = scales


def read(rows: torch.Tensor, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``[..., ·]`` taken from a part (any leading shape; whole blocks ``[k, n, ·]`` for a block-wide
    layout) as ``[..., width]`` values in ``dtype``."""
    fmt = format_of(rows, width)
    if fmt is None:
        return rows.to(dtype)
    if fmt.interleaved:
        return fmt.decode(rows[..., : fmt.data_bytes], rows[..., fmt.data_bytes:], dtype)
    return fmt.decode(*_sections(rows, fmt), dtype)


def roundtrip(x: torch.Tensor, fmt: V41KVFormat | None) -> torch.Tensor:
    """``x`` as it reads back from a part in layout ``fmt`` (``x`` itself for None), in ``x``'s dtype."""
    if fmt is None:
        return x
    return fmt.decode(*fmt.encode(x), x.dtype)
