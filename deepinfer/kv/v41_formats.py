"""DeepSeek-V4.1's quantized KV layouts as byte formats, with plain-torch writers and readers (the CPU oracle).

The reference (DeepInfer 0.1.0, ``tilelang_ops/cache_common.py``; reference/deepinfer.md §3, reference/kernels.md
FlashMLA's table) stores, per token:

- ``MXFP8`` (main and SWA KV, ``use_fp4_sparse_kv: false``; SWA always): 512 e4m3 values, then 16 ue8m0 scales,
  one per 32 values — 528 bytes, token-interleaved ``[data | scales]``. Scales are powers of two,
  ``2^ceil(log2(amax/448))`` (the reference's ``per_token_cast(round_sf=True)``): the rows of
  ``cache.kv_dtype: fp8`` (``kv/fp8.py``, which writes them here too). The bytes differ from the reference's
  only for a group whose amax is below 1e-4 (the reference floors amax there, ``kv/fp8.py`` at 2^-100).
- ``FP4_MAIN`` (main KV, ``use_fp4_sparse_kv: true``, the default): 512 e2m1 values packed two a byte (even
  index in the low nibble), then 32 e4m3 scales, one per 16 values — 288 bytes, token-interleaved. Scales are
  ``amax/6`` rounded to the nearest e4m3 (amax at least ``2^-9 · 6``; values beyond ±6 after scaling saturate).
- ``FP4_INDEX`` (the indexer's keys, ``index_head_dim`` 128): 128 e2m1 values then 4 ue8m0 scales, one per 32 —
  68 bytes; in a block the data of every token comes first, then every token's scales (block-wide sections).

A paged block of a token-interleaved format is ``block_size × bytes_per_token`` bytes with its stride aligned
to ``lcm(32, bytes_per_token)`` (``block_stride``). ``at(width)`` gives a layout for another width (tiny test
models). The KV pool stores DeepSeek-V4.1's caches in these layouts under ``cache.kv_dtype: fp4`` / ``fp8``,
and the reference attention and indexer read them (``kv/v41_cache.py``; docs/status.md, issue 33).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from deepinfer.kv import fp8
from deepinfer.model.layers.fp4 import E2M1_MAX, dequantize_e2m1, e2m1_codes, pack_e2m1, quantize_e2m1

E4M3_MAX = 448.0
E4M3_MIN_POSITIVE = 2.0 ** -9  # the reference's floor of an FP4 group's amax/6


@dataclass(frozen=True)
class V41KVFormat:
    """One token's record: ``elements`` values in ``values`` (``e2m1`` packed or ``e4m3``), one ``scales``
    scale per ``per_scale`` values; ``interleaved``: ``[data | scales]`` per token, else block-wide sections."""

    name: str
    values: Literal["e2m1", "e4m3"]
    elements: int
    per_scale: int
    scales: Literal["ue8m0", "e4m3"]
    interleaved: bool

    @property
    def data_bytes(self) -> int:
        return self.elements // 2 if self.values == "e2m1" else self.elements

    @property
    def scale_bytes(self) -> int:
        return self.elements // self.per_scale

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    def at(self, elements: int) -> V41KVFormat:
        """This layout for ``elements`` values a token (the reference's widths are 512 and 128; tiny models have
        fewer): the same value and scale types and group size. ``elements`` must be a multiple of the group."""
        if elements <= 0 or elements % self.per_scale:
            raise ValueError(f"{self.name}: {elements} values a token is not a positive multiple of its "
                             f"{self.per_scale}-value scale group")
        return self if elements == self.elements else replace(self, elements=elements)

    def block_stride(self, block_size: int) -> int:
        """Bytes between paged blocks: ``block_size`` records rounded up to ``lcm(32, bytes_per_token)``
        (interleaved) or 32 (block-wide sections), as the reference allocates."""
        align = math.lcm(32, self.bytes_per_token) if self.interleaved else 32
        return -(-block_size * self.bytes_per_token // align) * align

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., elements]`` → ``(data uint8 [..., data_bytes], scales uint8 [..., scale_bytes])``."""
        if x.shape[-1] != self.elements:
            raise ValueError(f"{self.name}: expected {self.elements} values per token, got {x.shape[-1]}")
        if self.values == "e4m3":  # the data of ``cache.kv_dtype: fp8`` (kv/fp8.py), one writer for both
            data, scales = fp8.quantize(x)
            return data.view(torch.uint8), scales
        if self.scales == "ue8m0":
            return quantize_e2m1(x, self.per_scale, "ue8m0")
        groups = x.float().unflatten(-1, (-1, self.per_scale))
        amax = groups.abs().amax(-1).clamp_min(E4M3_MIN_POSITIVE * E2M1_MAX)
        sf = (amax / E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)
        codes = e2m1_codes(groups / sf.float().unsqueeze(-1))
        return pack_e2m1(codes.flatten(-2)), sf.view(torch.uint8)

    def decode(self, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The inverse view: ``[..., elements]`` in ``dtype`` (exact products in float32, then cast)."""
        if self.values == "e2m1":
            return dequantize_e2m1(data, scales, self.per_scale, self.scales, dtype, name=self.name)
        return fp8.dequantize(data.view(torch.float8_e4m3fn), scales, dtype)

    def write_block(self, block: torch.Tensor, x: torch.Tensor, block_size: int) -> None:
        """Encode ``x [n, elements]`` (n ≤ ``block_size``) into the first n tokens of one paged block
        ``block uint8 [block_stride(block_size)]`` laid out as this format says."""
        data, scales = self.encode(x)
        n = self._check(block, x.shape[0], block_size)
        if self.interleaved:
            records = block[: n * self.bytes_per_token].view(n, self.bytes_per_token)
            records[:, : self.data_bytes] = data
            records[:, self.data_bytes:] = scales
        else:
            block[: n * self.data_bytes] = data.reshape(-1)
            start = block_size * self.data_bytes
            block[start: start + n * self.scale_bytes] = scales.reshape(-1)

    def read_block(self, block: torch.Tensor, n: int, block_size: int, dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
        """The first ``n`` tokens of one paged block of ``block_size`` tokens, decoded: ``[n, elements]``."""
        self._check(block, n, block_size)
        if self.interleaved:
            records = block[: n * self.bytes_per_token].view(n, self.bytes_per_token)
            return self.decode(records[:, : self.data_bytes], records[:, self.data_bytes:], dtype)
        data = block[: n * self.data_bytes].view(n, self.data_bytes)
        start = block_size * self.data_bytes
        return self.decode(data, block[start: start + n * self.scale_bytes].view(n, self.scale_bytes), dtype)

    def _check(self, block: torch.Tensor, n: int, block_size: int) -> int:
        if block.dtype != torch.uint8 or block.numel() != self.block_stride(block_size) or not 0 <= n <= block_size:
            raise ValueError(f"{self.name}: a block of {block_size} tokens is uint8 [{self.block_stride(block_size)}] "
                             f"holding at most {block_size} tokens; got {block.dtype} [{block.numel()}] and {n}")
        return n


MXFP8 = V41KVFormat("mxfp8", "e4m3", 512, 32, "ue8m0", interleaved=True)
FP4_MAIN = V41KVFormat("fp4", "e2m1", 512, 16, "e4m3", interleaved=True)
FP4_INDEX = V41KVFormat("fp4_index", "e2m1", 128, 32, "ue8m0", interleaved=False)
V41_KV_FORMATS = {f.name: f for f in (MXFP8, FP4_MAIN, FP4_INDEX)}
"""The formats by name (``fp4`` is the ``cache.kv_dtype`` value that names the FP4 main-KV layout)."""
