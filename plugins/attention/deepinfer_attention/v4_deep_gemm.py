"""``deep_gemm_v4``: the V4 indexer's decode scores through DeepGEMM's ``fp8_fp4_paged_mqa_logits``
(op ``indexer_topk``; ``reference/kernels.md`` §2, SM90 and SM100). Checked on the H200 with DeepGEMM
2.8.2 (``tests/test_v4_gpu.py::test_deep_gemm_indexer_matches_reference``: the same −1 holes as the
reference and over 90% of its picks on V4-Flash-shaped decode rows); SM100 not run. DeepGEMM takes
context lengths ``[rows, next_n]`` (here ``next_n = 1``) for both the schedule and the logits.

DeepGEMM reads FP8 keys in its own paged layout: blocks of 64 tokens, each block
``[64 · dim e4m3 values | 64 float32 scales]`` viewed as ``[blocks, 64, 1, dim + 4]`` uint8. Our
indexer keys are model-dtype ``[num_blocks, block_size / ratio, dim]``, so every call gathers each
decode row's entries (the block tables' whole width) into that layout, quantizing per entry
(``amax / 448``). That copy reads the keys once more than the kernel does: this adapter checks
DeepGEMM's numbers and its call, it is not a speed-up (H200, 32k context, batch 1 / 16 / 64: 0.49 /
0.60 / 1.77 ms against ``triton_v4``'s 0.15 / 0.14 / 0.23; a mirror FP8 cache written by the
compressor would remove the copy). Queries are quantized per (row, head) and the scale is folded into
the head weight, which is exact because ``relu(s·x) = s·relu(x)`` for ``s > 0``.

A step with a row of several query tokens takes the reference path whole. FP8 changes scores, hence sometimes picks:
``kernels.attention: auto`` never takes this backend; name it (the V4 attention op itself then comes
from ``auto``).
"""

from __future__ import annotations

import importlib.util

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.ops import TorchSinkAttentionBackend
from deepinfer_attention.triton_v4 import all_decode, topk_entries

_BLOCK_KV = 64  # DeepGEMM's paged block of index keys
_FP8_MAX = 448.0  # largest finite e4m3 value


def deep_gemm_ready() -> bool:
    """``deep_gemm`` is installed and a CUDA device of compute capability ≥ 9 is present (its import
    needs CUDA: never tried on CPU-only machines)."""
    if importlib.util.find_spec("deep_gemm") is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def pack_fp8_keys(keys: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's entries (``block_tables [B, max_blocks]`` over ``keys [num_blocks, per_block, dim]``)
    as DeepGEMM FP8 paged keys: ``(cache uint8 [B · n, 64, 1, dim + 4], table int32 [B, n])`` with
    ``n = ⌈max_blocks · per_block / 64⌉``; request b's entry e is token e of its table."""
    batch, per_block, dim = block_tables.shape[0], keys.shape[1], keys.shape[2]
    width = block_tables.shape[1] * per_block
    n = -(-width // _BLOCK_KV)
    rows = (block_tables.unsqueeze(-1) * per_block + torch.arange(per_block, device=keys.device)).flatten(1)
    entries = keys.reshape(-1, dim).index_select(0, rows.flatten()).view(batch, width, dim).float()
    entries = torch.nn.functional.pad(entries, (0, 0, 0, n * _BLOCK_KV - width))
    scale = (entries.abs().amax(dim=-1) / _FP8_MAX).clamp_min(1e-10)  # [B, n · 64]
    values = (entries / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    cache = torch.empty(batch * n, _BLOCK_KV * (dim + 4), dtype=torch.uint8, device=keys.device)
    cache[:, : _BLOCK_KV * dim] = values.view(torch.uint8).reshape(batch * n, _BLOCK_KV * dim)
    cache[:, _BLOCK_KV * dim:] = scale.reshape(batch * n, _BLOCK_KV).view(torch.uint8)
    table = torch.arange(batch * n, dtype=torch.int32, device=keys.device).view(batch, n)
    return cache.view(batch * n, _BLOCK_KV, 1, dim + 4), table


class DeepGemmIndexerBackend:
    """Op ``indexer_topk`` with DeepGEMM's paged MQA logits on decode rows (module docstring)."""

    name = "deep_gemm_v4"
    priority = -1  # below the reference (0): FP8 scores, so only used when named
    ops = frozenset({"indexer_topk"})
    capabilities = BackendCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.bfloat16}),
                                       graph_safe=True, varlen=True)

    def __init__(self) -> None:
        self.reference = TorchSinkAttentionBackend()

    def available(self) -> bool:
        return deep_gemm_ready()

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, *,
                     ratio: int, topk: int, scale: float) -> torch.Tensor:
        """Same contract as ``TorchSinkAttentionBackend.indexer_topk``."""
        if all_decode(ctx):
            return self._decode(q, weights, keys, ctx, ratio, topk, scale)
        return self.reference.indexer_topk(q, weights, keys, ctx, ratio=ratio, topk=topk, scale=scale)

    @staticmethod
    def _decode(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, ratio: int,
                topk: int, scale: float) -> torch.Tensor:
        import deep_gemm  # CUDA only: available() checked it

        n = q.shape[0]
        cache, table = pack_fp8_keys(keys, ctx.block_tables[:n])
        q_scale = (q.float().abs().amax(dim=-1) / _FP8_MAX).clamp_min(1e-10)  # [n, heads]
        q_fp8 = (q.float() / q_scale.unsqueeze(-1)).to(torch.float8_e4m3fn).unsqueeze(1)  # [n, 1, heads, dim]
        head_w = (weights.float() * q_scale * scale).contiguous()
        complete = ((ctx.positions[:n] + 1) // ratio).to(torch.int32).unsqueeze(1).contiguous()  # [n, next_n = 1]
        width = table.shape[1] * _BLOCK_KV
        schedule = deep_gemm.get_paged_mqa_logits_metadata(complete, _BLOCK_KV, deep_gemm.get_num_sms())
        logits = deep_gemm.fp8_fp4_paged_mqa_logits((q_fp8, None), cache, head_w, complete, table, schedule, width)
        visible = torch.arange(width, device=q.device) < complete
        return topk_entries(logits.float().masked_fill(~visible, float("-inf")), topk)
