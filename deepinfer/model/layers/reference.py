"""The core's reference backends in plain torch: correct on CPU and GPU, the oracle for kernels.

Attention over the paged cache: decode rows (one query each) are gathered into one padded batch and
answered by one SDPA call; prefill chunks are answered one request at a time. GQA is handled by
folding each KV head's query group into the query-length axis, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities, ForwardContext

_ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
             slot_mapping: torch.Tensor) -> None:
    """Store this step's ``k, v [T, Hkv, D]`` at their flat cache slots."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``cache[block_table]`` as ``[..., blocks·block_size, Hkv, D]`` (``index_select`` copies
    whole blocks and is several times faster than advanced indexing on CPU)."""
    blocks = cache.index_select(0, block_table.reshape(-1))
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """``q [B, n, Hq, D]`` against ``k, v [B, L, Hkv, D]`` with ``mask [B, n, L]`` (True = visible).
    Returns ``[B, n, Hq, D]``."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    qg = q.reshape(b, n, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * n, d)
    full_mask = mask.unsqueeze(1).unsqueeze(2).expand(b, 1, group, n, mask.shape[-1]).reshape(b, 1, group * n, -1)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=full_mask,
                                         scale=scale)
    return out.reshape(b, hkv, group, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, hq, d)


def _visible(query_pos: torch.Tensor, key_len: int, window: int) -> torch.Tensor:
    """``[..., n, L]`` mask: key position j is visible to a query at position p iff j <= p and, with
    a window, j > p − window."""
    keys = torch.arange(key_len, device=query_pos.device)
    p = query_pos.unsqueeze(-1)
    mask = keys <= p
    if window > 0:
        mask &= keys > p - window
    return mask


class TorchAttentionBackend:
    """Reference paged attention (op ``paged_attention``)."""

    name = "torch"
    priority = 0
    ops = frozenset({"paged_attention"})
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, varlen=True)

    def available(self) -> bool:
        return True

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext, *,
                        scale: float, window: int = 0) -> torch.Tensor:
        write_kv(k, v, kv_cache, ctx.slot_mapping)
        out = torch.empty_like(q)
        nd = ctx.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, ctx, scale, window)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        for i in range(nd, len(lens)):
            lo, hi = starts[i], starts[i + 1]
            out[lo:hi] = self._prefill(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, ctx, i, scale, window)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
                scale: float, window: int) -> torch.Tensor:
        nd = q.shape[0]
        max_len = max(ctx.seq_lens_host[:nd])
        table = ctx.block_tables[:nd, : -(-max_len // ctx.block_size)]
        k, v = _gather(kv_cache[0], table), _gather(kv_cache[1], table)
        query_pos = (ctx.seq_lens[:nd] - 1).unsqueeze(-1)
        mask = _visible(query_pos, k.shape[1], window)
        return _grouped_sdpa(q.unsqueeze(1), k, v, mask, scale).squeeze(1)

    def _prefill(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext, i: int, scale: float,
                 window: int) -> torch.Tensor:
        n, seq_len = q.shape[0], ctx.seq_lens_host[i]
        if n == seq_len and window == 0:  # nothing cached before this chunk: plain causal attention
            out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k_new.transpose(0, 1).unsqueeze(0),
                                                 v_new.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                                 enable_gqa=True)
            return out.squeeze(0).transpose(0, 1)
        if n == seq_len:
            k, v = k_new, v_new
        else:
            table = ctx.block_tables[i, : -(-seq_len // ctx.block_size)]
            k, v = _gather(kv_cache[0], table)[:seq_len], _gather(kv_cache[1], table)[:seq_len]
        query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        mask = _visible(query_pos, seq_len, window)
        return _grouped_sdpa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask.unsqueeze(0), scale).squeeze(0)


class TorchGemmBackend:
    """Reference GEMM (op ``linear``): ``torch.nn.functional.linear``."""

    name = "torch"
    priority = 0
    ops = frozenset({"linear"})
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, graph_safe=True)

    def available(self) -> bool:
        return True

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """On CPU, store ``[out, in]`` weights column-major (``weightᵀ`` contiguous): BLAS reads them
        with unit stride along ``out``, which measured 10–50% faster for decode-sized inputs
        (docs/benchmarks.md)."""
        return weight.t().contiguous().t() if weight.device.type == "cpu" else weight

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)
