"""``triton_bi`` (op ``linear``), ``triton_bi`` (op ``paged_attention``) and ``triton_bi_mla`` (op
``mla_attention``): the GPU backends of ``kernels.batch_invariant`` (reference/deepinfer.md §9).

A request's logits are bitwise the same alone or in any batch when every op computes each row in an
order fixed by the row's own problem (``batch_invariant_kernels.py`` says how each kernel does it):

- ``linear``: ``bi_matmul`` with constant tiles and no split-K, instead of cuBLAS, whose kernel (tiles,
  split-K) follows M;
- ``paged_attention`` / ``mla_attention``: every query token, prefill and decode alike, through the
  fixed-chunk kernels, so neither the batch nor how a prompt was chunked changes a token's output. MLA
  runs in the weight-absorbed form for every row; its two per-head projections go through ``bi_matmul``
  too (``torch.bmm`` would pick its kernel by the number of tokens).

What they cost (README.md, "Batch invariance"): decode GEMMs run 64-row tiles for one row, attention
has no batch-dependent split heuristic (a short batch with long contexts is still spread by its
chunks), and prefill reads each query token's keys once per token (no query tiling), so long prompts
are much slower than with the default backends.

``available()`` needs ``import triton`` and CUDA, or ``TRITON_INTERPRET=1`` (the CPU tests). Under the
interpreter they also declare the CPU device with a priority below the core's CPU batch-invariant
backends, so a CPU ``auto`` run is unchanged and these run only when named. On CUDA their priority is
below the default backends' (a run without the mode never picks them) and no other GPU backend declares
``batch_invariant``, so ``auto`` picks these exactly when the mode is on.
"""

from __future__ import annotations

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.ops import write_kv
from deepinfer.testing import triton_interpreting
from deepinfer_attention.triton_backends import triton_usable

_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
# Below every default backend (the core's torch ones are 0): a backend that declares batch_invariant
# also fits runs that do not ask for it, and must not win those. On CUDA nothing else declares the
# capability, so the mode still picks these; interpreting, they also rank below the core's CPU
# batch-invariant backends (-10).
_GPU_PRIORITY = -5
_INTERPRETER_PRIORITY = -20


def _capabilities() -> BackendCapabilities:
    devices = frozenset({"cuda", "cpu"}) if triton_interpreting() else frozenset({"cuda"})
    return BackendCapabilities(devices=devices, dtypes=_DTYPES, graph_safe=True, batch_invariant=True, varlen=True)


def _token_req(ctx: ForwardContext, num_tokens: int) -> torch.Tensor | None:
    """Each query token's request, computed on the device from ``query_start_loc``; ``None`` for a
    decode-only step (token ``t`` is request ``t``). Reads no host list when the context states its
    bound (a CUDA-graph replay) or every row is a decode row."""
    if ctx.max_query_len == 1 or (not ctx.max_query_len and ctx.num_decodes == ctx.block_tables.shape[0]):
        return None
    starts = ctx.query_start_loc
    tokens = torch.arange(num_tokens, dtype=starts.dtype, device=starts.device)
    return torch.searchsorted(starts, tokens, right=True) - 1


class _TritonBI:
    """What the three backends share: availability and capabilities."""

    def __init__(self) -> None:
        self.priority = _INTERPRETER_PRIORITY if triton_interpreting() else _GPU_PRIORITY
        self.capabilities = _capabilities()

    def available(self) -> bool:
        return triton_usable()


class TritonBIGemmBackend(_TritonBI):
    """Op ``linear`` through ``bi_matmul`` (weights kept as loaded, ``[out, in]``)."""

    name = "triton_bi"
    ops = frozenset({"linear"})

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ weight[out, in]ᵀ (+ bias)``; the bias is added element-wise afterwards."""
        from deepinfer_attention.batch_invariant_kernels import bi_matmul  # imports triton

        flat = x.reshape(1, -1, x.shape[-1])
        out = bi_matmul(flat, weight.unsqueeze(0))[0]
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])


class TritonBIAttentionBackend(_TritonBI):
    """Op ``paged_attention`` (GQA, sliding window, visibility floor) through ``chunked_gqa_attention``
    for every query token."""

    name = "triton_bi"
    ops = frozenset({"paged_attention"})

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext, *,
                        scale: float, window: int = 0) -> torch.Tensor:
        """The ``AttentionBackend`` contract (``deepinfer/interfaces.py``)."""
        from deepinfer_attention.batch_invariant_kernels import chunked_gqa_attention  # imports triton

        write_kv(k, v, kv_cache, ctx.slot_mapping)
        floor = ctx.visibility_floor if window > 0 else None
        return chunked_gqa_attention(q, kv_cache[0], kv_cache[1], ctx.block_tables, ctx.positions,
                                     _token_req(ctx, q.shape[0]), scale=scale, window=window,
                                     visibility_floor=floor)


class TritonBIMLABackend(_TritonBI):
    """Op ``mla_attention`` in the weight-absorbed form for every row (``TorchMLABackend``'s layout):
    ``q_lat = q_nope · W_UK`` and ``o · W_UVᵀ`` per head through ``bi_matmul``, the attention through
    ``chunked_mla_attention``."""

    name = "triton_bi_mla"
    ops = frozenset({"mla_attention"})

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      cache: tuple[torch.Tensor, ...], ctx: ForwardContext, *, kv_b_weight: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """The ``TorchMLABackend.mla_attention`` contract: ``q_nope [T, H, N]``, ``q_pe [T, H, R]``,
        ``latent [T, C]``, ``k_pe [T, R]``, ``cache = ([blocks, block_size, C + R],)``,
        ``kv_b_weight [H·(N+V), C]``; returns ``[T, H, V]``."""
        from deepinfer_attention.batch_invariant_kernels import bi_matmul, chunked_mla_attention  # imports triton

        rows = cache[0]
        rows.view(-1, rows.shape[-1]).index_copy_(0, ctx.slot_mapping, torch.cat([latent, k_pe], dim=-1))
        heads, nope = q_nope.shape[1], q_nope.shape[2]
        per_head = kv_b_weight.unflatten(0, (heads, -1))  # [H, N+V, C]
        w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
        q_lat = bi_matmul(q_nope.transpose(0, 1), w_uk.transpose(1, 2)).transpose(0, 1)  # [T, H, C]
        o = chunked_mla_attention(q_lat, q_pe, rows, ctx.block_tables, ctx.positions, _token_req(ctx, q_nope.shape[0]),
                                  scale=scale)
        return bi_matmul(o.transpose(0, 1), w_uv).transpose(0, 1)  # [T, H, V]
