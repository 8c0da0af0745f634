"""Reference backends for DeepSeek-style models in plain torch: MLA attention over the paged latent
cache (op ``mla_attention``) and grouped MoE experts (op ``experts``). Correct on CPU and GPU; the
oracles for kernels.

MLA (multi-head latent attention) caches, per token, the compressed latent ``c`` (``kv_lora_rank``,
after ``kv_a_layernorm``) and the shared rope key ``k_pe`` (already rotated), as one row
``[c, k_pe]`` of a ``PagedLatentSpec`` tensor (with an FP8 cache, ``kv/fp8.py``, quantized on write
and dequantized on read, scales in the layer's second tensor). ``kv_b_proj`` (``[H·(N+V), C]``) holds, per head, the
up-projections ``W_UK [N, C]`` (no-rope key) and ``W_UV [V, C]`` (value).

- Decode rows use the weight-absorbed form: ``q_nope`` is folded into the latent space
  (``q_lat = q_nope · W_UK``), every head attends with ``[q_lat, q_pe]`` against the single shared
  row ``[c, k_pe]`` (one KV head, all query heads folded into the query axis, one padded SDPA call
  for the whole decode batch), and the latent-space output goes through ``W_UV``.
- Prefill chunks are answered one request at a time in the expanded form: the request's latents are
  projected through ``kv_b_proj`` into per-head keys and values, then ordinary causal SDPA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.kv import fp8
from deepinfer.model.layers.reference import ALL_KV_DTYPES, _visible

_ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


class TorchMLABackend:
    """Reference MLA attention over the paged latent cache (op ``mla_attention``)."""

    name = "torch_mla"
    priority = 0
    ops = frozenset({"mla_attention"})
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, kv_dtypes=ALL_KV_DTYPES, varlen=True)

    def available(self) -> bool:
        return True

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      cache: tuple[torch.Tensor, ...], ctx: ForwardContext, *, kv_b_weight: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """``q_nope [T, H, N]``, ``q_pe [T, H, R]`` (rotated), ``latent [T, C]``, ``k_pe [T, R]``
        (rotated); ``cache`` is the layer's ``([num_blocks, block_size, C + R],)`` (FP8: ``(rows,
        scales)``, ``write_latent``); ``kv_b_weight [H·(N+V), C]``. Writes this step's ``[latent, k_pe]``
        rows at ``ctx.slot_mapping``, then attends causally. Returns ``[T, H, V]``."""
        write_latent(latent, k_pe, cache, ctx.slot_mapping)
        if len(cache) == 2:  # a prefill's fresh rows, read without the cache, must be what decode reads
            latent, k_pe = fp8.roundtrip(latent), fp8.roundtrip(k_pe)
        heads, nope = q_nope.shape[1], q_nope.shape[2]
        per_head = kv_b_weight.unflatten(0, (heads, -1))  # [H, N+V, C]
        w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
        out = q_nope.new_empty(q_nope.shape[0], heads, w_uv.shape[1])
        nd = ctx.num_decodes
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], cache, ctx, w_uk, w_uv, scale)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        for i in range(nd, len(lens)):
            lo, hi = starts[i], starts[i + 1]
            out[lo:hi] = self._prefill(q_nope[lo:hi], q_pe[lo:hi], latent[lo:hi], k_pe[lo:hi], cache, ctx, i,
                                       kv_b_weight, nope, scale)
        return out

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: tuple[torch.Tensor, ...], ctx: ForwardContext,
                w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        nd, latent_dim = q_nope.shape[0], w_uk.shape[2]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [nd, H, C]
        query = torch.cat([q_lat, q_pe], dim=-1).unsqueeze(1)  # [nd, 1, H, C+R]: heads on the query axis
        max_len = max(ctx.seq_lens_host[:nd])
        table = ctx.block_tables[:nd, : -(-max_len // ctx.block_size)]
        keys = gather_latent(cache, table, query.dtype, latent_dim).unsqueeze(1)  # [nd, 1, L, C+R]: one shared KV head
        mask = _visible((ctx.seq_lens[:nd] - 1).unsqueeze(-1), keys.shape[2], 0).unsqueeze(1)  # [nd, 1, 1, L]
        o = F.scaled_dot_product_attention(query, keys, keys[..., :latent_dim], attn_mask=mask, scale=scale)
        return torch.bmm(o.squeeze(1).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [nd, H, V]

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                 cache: tuple[torch.Tensor, ...], ctx: ForwardContext, i: int, kv_b_weight: torch.Tensor, nope: int,
                 scale: float) -> torch.Tensor:
        n, seq_len, latent_dim = q_nope.shape[0], ctx.seq_lens_host[i], latent.shape[1]
        if n == seq_len:  # nothing cached before this chunk
            lat, pe = latent, k_pe
        else:
            table = ctx.block_tables[i, : -(-seq_len // ctx.block_size)]
            cached = gather_latent(cache, table, latent.dtype, latent_dim)[:seq_len]
            lat, pe = cached[:, :latent_dim], cached[:, latent_dim:]
        heads = q_nope.shape[1]
        kv = F.linear(lat, kv_b_weight).view(seq_len, heads, -1)  # [L, H, N+V]
        k = torch.cat([kv[..., :nope], pe.unsqueeze(1).expand(-1, heads, -1)], dim=-1).transpose(0, 1)
        v = kv[..., nope:].transpose(0, 1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, n, N+R]
        if n == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            mask = _visible(torch.arange(seq_len - n, seq_len, device=q.device), seq_len, 0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o.transpose(0, 1)  # [n, H, V]


def write_latent(latent: torch.Tensor, k_pe: torch.Tensor, cache: tuple[torch.Tensor, ...],
                 slot_mapping: torch.Tensor) -> None:
    """Store rows ``[latent, k_pe]`` (``[T, C]``, ``[T, R]``) at flat slots ``slot_mapping [T]`` of an MLA
    cache: ``(rows,)`` (cast to its dtype) or, FP8, ``(rows, scales)``, the latent and the rope key
    quantized each in its own groups (``PagedLatentSpec``, ``kv/fp8.py``)."""
    rows, latent_dim = cache[0], latent.shape[1]
    if len(cache) == 2:
        split = fp8.num_groups(latent_dim)
        fp8.store(rows[..., :latent_dim], cache[1][..., :split], slot_mapping, latent)
        fp8.store(rows[..., latent_dim:], cache[1][..., split:], slot_mapping, k_pe)
        return
    rows.view(-1, rows.shape[-1]).index_copy_(0, slot_mapping, torch.cat([latent, k_pe], dim=-1).to(rows.dtype))


def gather_latent(cache: tuple[torch.Tensor, ...], block_table: torch.Tensor, dtype: torch.dtype,
                  latent_dim: int) -> torch.Tensor:
    """Rows ``[c, k_pe]`` (``c`` of width ``latent_dim``) of ``block_table``'s blocks as ``[...,
    blocks·block_size, C + R]`` in ``dtype`` (dequantized from an FP8 cache)."""
    if len(cache) == 1:
        return fp8.gather(cache[0], None, block_table, dtype)
    rows, scales = cache
    split = fp8.num_groups(latent_dim)
    return torch.cat([fp8.gather(rows[..., :latent_dim], scales[..., :split], block_table, dtype),
                      fp8.gather(rows[..., latent_dim:], scales[..., split:], block_table, dtype)], dim=-1)


class TorchMoEBackend:
    """Reference MoE experts (op ``experts``): tokens sorted by expert, one SwiGLU GEMM pair per
    active expert, results scattered back weighted."""

    name = "torch"
    priority = 0
    ops = frozenset({"experts"})
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, graph_safe=False)

    def available(self) -> bool:
        return True

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                weights: tuple[torch.Tensor, torch.Tensor], *, swiglu_limit: float | None = None) -> torch.Tensor:
        """``x [T, H]``, ``topk_ids``/``topk_weights [T, k]``, ``weights = (w13 [E, 2I, H] (gate rows
        then up rows), w2 [E, H, I])`` → ``Σ_j topk_weights[t, j] · expert_{ids[t, j]}(x[t])`` ``[T, H]``.
        ``swiglu_limit`` clamps gate (above) and up (both sides) first. Accumulates in float32; reads
        the per-expert counts on the host once."""
        return sorted_experts(x, topk_ids, topk_weights, weights, swiglu_limit, F.linear)


def sorted_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   weights: tuple[torch.Tensor, torch.Tensor], swiglu_limit: float | None,
                   linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The reference expert compute with a given ``linear``: tokens sorted by expert, one pair of
    matmuls per active expert, top-k contributions accumulated in float32 in ascending expert id."""
    w13, w2 = weights
    num_experts, inter = w13.shape[0], w2.shape[2]
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    weight_of = topk_weights.reshape(-1).float()[order]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        idx = token_of[start:start + count]
        gate, up = linear(x.index_select(0, idx), w13[e]).split(inter, dim=-1)
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
        y = linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, idx, y.float() * weight_of[start:start + count, None])
        start += count
    return out.to(x.dtype)
