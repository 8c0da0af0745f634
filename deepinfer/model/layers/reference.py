"""The core's reference backends in plain torch: correct on CPU and GPU, the oracle for kernels.

Attention over the paged cache: decode rows (one query each) are gathered into one padded batch and
answered by one SDPA call, and so are requests with a few query tokens past a cached context
(verification rows, ``FEW_QUERY_ROWS``); prefill chunks are answered one request at a time, in blocks
of query rows against only the keys each block can see (window-banded on sliding layers). GQA is handled by
folding each KV head's query group into the query-length axis, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.kv import fp8

_ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
# cache.kv_dtype values the reference attention reads (kv/fp8.py).
ALL_KV_DTYPES = frozenset({"auto", "bf16", "fp8"})
# Query rows per attention call in prefill: a block's mask and scores are [rows, visible keys], so a long
# prompt never builds an L×L mask (sliding layers: rows × (rows + window − 1); full layers: rows × L).
PREFILL_QUERY_ROWS = 1024
# Requests with at most this many query tokens past a cached context (verification rows: the last token
# and its drafts) are answered together in one padded SDPA call, like decode rows, instead of one call each.
FEW_QUERY_ROWS = 16


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
             slot_mapping: torch.Tensor) -> None:
    """Store this step's ``k, v [T, Hkv, D]`` at their flat cache slots: quantized into an FP8 cache
    ``(k, v, k_scales, v_scales)`` (``kv/fp8.py``), else cast to the cache's dtype."""
    if len(kv_cache) == 4:
        fp8.store(kv_cache[0], kv_cache[2], slot_mapping, k)
        fp8.store(kv_cache[1], kv_cache[3], slot_mapping, v)
        return
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(kv_cache: tuple[torch.Tensor, ...], block_table: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``block_table``'s blocks as ``[..., blocks·block_size, Hkv, D]`` in ``dtype``
    (dequantized from an FP8 cache)."""
    k_scales, v_scales = kv_cache[2:] if len(kv_cache) == 4 else (None, None)
    return (fp8.gather(kv_cache[0], k_scales, block_table, dtype),
            fp8.gather(kv_cache[1], v_scales, block_table, dtype))


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


def _visible(query_pos: torch.Tensor, key_len: int, window: int,
             floor: torch.Tensor | int = 0) -> torch.Tensor:
    """``[..., n, L]`` mask: key position j is visible to a query at position p iff j <= p and, with
    a window, j > p − window and (j >= ``floor`` or j == p) (bounded replay, ``ForwardContext``;
    ``floor`` broadcasts against ``query_pos``)."""
    keys = torch.arange(key_len, device=query_pos.device)
    p = query_pos.unsqueeze(-1)
    mask = keys <= p
    if window > 0:
        mask &= keys > p - window
        if not isinstance(floor, int) or floor > 0:
            mask &= (keys >= (floor.unsqueeze(-1) if isinstance(floor, torch.Tensor) else floor)) | (keys == p)
    return mask


class TorchAttentionBackend:
    """Reference paged attention (op ``paged_attention``)."""

    name = "torch"
    priority = 0
    ops = frozenset({"paged_attention"})
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, kv_dtypes=ALL_KV_DTYPES, varlen=True)

    def available(self) -> bool:
        return True

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, ...], ctx: ForwardContext, *,
                        scale: float, window: int = 0) -> torch.Tensor:
        write_kv(k, v, kv_cache, ctx.slot_mapping)
        if len(kv_cache) == 4:  # a prefill's fresh K/V, read without the cache, must be what decode reads
            k, v = fp8.roundtrip(k), fp8.roundtrip(v)
        out = torch.empty_like(q)
        nd = ctx.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, ctx, scale, window)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        few = [i for i in range(nd, len(lens)) if starts[i + 1] - starts[i] <= min(FEW_QUERY_ROWS, lens[i] - 1)]
        if few:
            self._few_queries(q, out, kv_cache, ctx, few, scale, window)
        taken = set(few)
        for i in range(nd, len(lens)):
            if i not in taken:
                lo, hi = starts[i], starts[i + 1]
                out[lo:hi] = self._prefill(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, ctx, i, scale, window)
        return out

    def _few_queries(self, q: torch.Tensor, out: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                     ctx: ForwardContext, rows: list[int], scale: float, window: int) -> None:
        """Requests ``rows`` (each a few queries past a cached context; this step's K/V are already in the
        cache) in one padded SDPA call over their gathered blocks; writes their outputs into ``out``."""
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        counts = [starts[i + 1] - starts[i] for i in rows]
        width = max(counts)
        dev = q.device
        # Row j of request r is query starts[r] + j (clamped to its last query for the padding rows).
        offsets = torch.arange(width, device=dev)
        first = torch.tensor([starts[i] for i in rows], dtype=torch.int64, device=dev)
        n = torch.tensor(counts, dtype=torch.int64, device=dev)
        index = first.unsqueeze(1) + torch.minimum(offsets, n.unsqueeze(1) - 1)
        seq_lens = torch.tensor([lens[i] for i in rows], dtype=torch.int64, device=dev)
        query_pos = seq_lens.unsqueeze(1) - n.unsqueeze(1) + torch.minimum(offsets, n.unsqueeze(1) - 1)
        max_len = max(lens[i] for i in rows)
        picked = torch.tensor(rows, dtype=torch.int64, device=dev)
        table = ctx.block_tables.index_select(0, picked)[:, : -(-max_len // ctx.block_size)]
        k, v = gather_kv(kv_cache, table, q.dtype)
        floor = 0 if ctx.visibility_floor is None else ctx.visibility_floor.index_select(0, picked).unsqueeze(-1)
        mask = _visible(query_pos, k.shape[1], window, floor)
        answer = _grouped_sdpa(q[index], k, v, mask, scale)  # [R, width, Hq, D]
        valid = offsets < n.unsqueeze(1)
        out[index[valid]] = answer[valid]

    def _decode(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], ctx: ForwardContext,
                scale: float, window: int) -> torch.Tensor:
        nd = q.shape[0]
        max_len = max(ctx.seq_lens_host[:nd])
        table = ctx.block_tables[:nd, : -(-max_len // ctx.block_size)]
        k, v = gather_kv(kv_cache, table, q.dtype)
        query_pos = (ctx.seq_lens[:nd] - 1).unsqueeze(-1)
        floor = 0 if ctx.visibility_floor is None else ctx.visibility_floor[:nd].unsqueeze(-1)
        mask = _visible(query_pos, k.shape[1], window, floor)
        return _grouped_sdpa(q.unsqueeze(1), k, v, mask, scale).squeeze(1)

    def _prefill(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, ...], ctx: ForwardContext, i: int, scale: float,
                 window: int) -> torch.Tensor:
        """Request ``i``'s chunk of ``n`` queries (positions ``seq_len − n ..``), answered
        ``PREFILL_QUERY_ROWS`` rows at a time, each block against only the keys it can see: from the
        window's start (or 0) up to its last query. Cache blocks older than the window are not gathered."""
        n, seq_len = q.shape[0], ctx.seq_lens_host[i]
        start = seq_len - n  # position of the chunk's first query
        if n == seq_len and window == 0 and n <= PREFILL_QUERY_ROWS:  # nothing cached, one block: plain causal
            out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k_new.transpose(0, 1).unsqueeze(0),
                                                 v_new.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                                 enable_gqa=True)
            return out.squeeze(0).transpose(0, 1)
        if n == seq_len:
            base, k, v = 0, k_new, v_new  # k[j] is position base + j
        else:
            bs = ctx.block_size
            base = (max(0, start - window + 1) if window > 0 else 0) // bs * bs
            table = ctx.block_tables[i, base // bs: -(-seq_len // bs)]
            k, v = gather_kv(kv_cache, table, q.dtype)
            k, v = k[:seq_len - base], v[:seq_len - base]
        floor = 0 if ctx.visibility_floor_host is None else ctx.visibility_floor_host[i]
        out = torch.empty_like(q)
        for lo in range(0, n, PREFILL_QUERY_ROWS):
            hi = min(n, lo + PREFILL_QUERY_ROWS)
            first, end = start + lo, start + hi  # query positions [first, end)
            k0 = max(base, first - window + 1) if window > 0 else base  # the block's oldest visible key
            # Positions relative to k0: the mask's rules (causal, window, floor) only compare differences.
            query_pos = torch.arange(first - k0, end - k0, device=q.device)
            mask = _visible(query_pos, end - k0, window, floor - k0)
            keys, values = k[k0 - base: end - base], v[k0 - base: end - base]
            out[lo:hi] = _grouped_sdpa(q[lo:hi].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                       mask.unsqueeze(0), scale).squeeze(0)
        return out


class TorchGemmBackend:
    """Reference GEMM (op ``linear``): ``torch.nn.functional.linear``."""

    name = "torch"
    priority = 0
    ops = frozenset({"linear"})
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, graph_safe=True)
    traceable = True  # plain F.linear: kernels.compile traces it (engine/compiled.py)

    def available(self) -> bool:
        return True

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """On CPU, store ``[out, in]`` weights column-major (``weightᵀ`` contiguous): BLAS reads them
        with unit stride along ``out``, which measured 10–50% faster for decode-sized inputs
        (docs/benchmarks.md)."""
        return weight.t().contiguous().t() if weight.device.type == "cpu" else weight

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)
