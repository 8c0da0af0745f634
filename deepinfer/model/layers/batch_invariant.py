"""Batch-invariant CPU backends: one request's logits are bitwise the same alone or in any batch.

Why the reference backends are not (peers.md §5; measured on this machine's MKL, docs/design.md):

- **GEMM.** BLAS picks its kernel and blocking from the number of rows M: a row of ``x @ Wᵀ`` computed
  with M = 1..3 differs in the last bits from the same row computed with M ≥ 4. So ``chunked_linear``
  computes every matmul in chunks of exactly ``ROW_CHUNK`` rows (the last one zero-padded), each chunk
  at a 64-byte-aligned offset of one buffer: every BLAS call has the same shape, and a row's result
  does not depend on its place inside the chunk (measured: every position gives the same bits).
- **Attention.** The reference answers a prefill chunk with SDPA over the chunk's own keys, decode rows
  with one padded SDPA over the batch's longest sequence, and chooses between them by how the request
  was chunked (a one-token chunk is a "decode" row). The SDPA kernel's splits depend on those lengths.
  ``fixed_split_attention`` gives every query row the same computation whatever its batch, its chunk
  and its label: keys are always read back from the paged cache; scores and the weighted sum of values
  are elementwise products reduced over the innermost axis (a reduction whose order depends only on
  that axis' length); softmax runs online over key splits of exactly ``KEY_SPLIT`` positions, in
  order, and a split past the query's last visible key changes nothing bitwise (its weights are exactly
  0 and its rescale factor exactly 1).
- **MLA** uses the weight-absorbed form for every row (prefill too), so a query's path does not depend
  on whether it arrived in a prefill chunk or as a decode row; the per-head projections are chunked bmms.
- **MoE.** The reference computes each expert over the tokens routed to it, so M is that count: the
  experts here use ``chunked_linear``; a token's expert outputs are summed in expert-id order, as before.

What needs no replacement (checked by tests/test_batch_invariant.py): RMSNorm, softmax/log-softmax and
the sampler's per-row ops reduce within a row (torch splits CPU reductions across rows, never inside a
row, when there is more than one output row; a single row is reduced serially below 32,768 elements),
and embeddings, rotary tables and the element-wise ops are per element — except that torch's CPU
element-wise kernels run a vector loop over a contiguous tensor's whole vectors and a scalar loop over the
rest, which may round differently: an activation over a contiguous ``[T, E]`` tensor must keep each row's
elements in the same loop whatever ``T`` is (the router's sigmoid pads its rows, ``routing.row_sigmoid``; the
MLPs' SiLU runs on the gate half of the gate/up output, a strided view iterated row by row). The MoE router's
gate matmul goes through the ``linear`` op like every other GEMM.

These backends declare ``batch_invariant`` and run on CPU only; their priority is below the
reference backends', so ``auto`` picks them only when ``kernels.batch_invariant`` is on. On CUDA the
same mode needs fixed-tile kernels: the ``attention`` and ``moe`` plugins offer them (``triton_bi``,
``triton_bi_mla``); without those plugins start-up fails there naming the missing capability. In this
mode RMSNorm pads to 16 rows on CUDA (``norm.mean_square``, set by the engine: CUDA reductions split
rows differently when fewer rows are reduced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.model.layers.reference import TorchGemmBackend, write_kv
from deepinfer.model.layers.reference_deepseek import sorted_experts

# Rows per BLAS call. 16 keeps each chunk of an fp32 or bf16 buffer 64-byte aligned for any width, and
# is the measured best compromise between decode (1 row padded to 16) and prefill (many calls).
ROW_CHUNK = 16
# Key positions per online-softmax split.
KEY_SPLIT = 64

_CPU = frozenset({"cpu"})
_DTYPES = frozenset({torch.float32, torch.bfloat16})
_CAPS = BackendCapabilities(devices=_CPU, dtypes=_DTYPES, batch_invariant=True, varlen=True)
_PRIORITY = -10  # below the reference backends: chosen by ``auto`` only when batch invariance is required


def _padded_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [rows, ...]`` copied into a zero-padded buffer of a multiple of ``ROW_CHUNK`` rows."""
    rows = x.shape[0]
    chunks = max(1, -(-rows // ROW_CHUNK))
    buf = x.new_zeros(chunks * ROW_CHUNK, *x.shape[1:])
    buf[:rows] = x
    return buf, chunks


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]ᵀ (+ bias)`` with every BLAS call on exactly ``ROW_CHUNK`` rows."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    buf, chunks = _padded_rows(flat)
    out = buf.new_empty(chunks * ROW_CHUNK, weight.shape[0])
    wt = weight.t()
    for c in range(chunks):
        lo = c * ROW_CHUNK
        torch.mm(buf[lo:lo + ROW_CHUNK], wt, out=out[lo:lo + ROW_CHUNK])
    result = out[:rows]
    if bias is not None:
        result = result + bias  # element-wise, after the matmul: the same bits for every row
    return result.reshape(*lead, weight.shape[0])


def chunked_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [B, rows, k] @ w [B, k, n]`` → ``[B, rows, n]`` with every bmm on exactly ``ROW_CHUNK`` rows
    (``B`` is a model constant, e.g. the heads)."""
    rows = x.shape[1]
    buf, chunks = _padded_rows(x.transpose(0, 1))  # [rows_padded, B, k]
    buf = buf.transpose(0, 1)
    out = x.new_empty(x.shape[0], chunks * ROW_CHUNK, w.shape[2])
    for c in range(chunks):
        lo = c * ROW_CHUNK
        out[:, lo:lo + ROW_CHUNK] = torch.bmm(buf[:, lo:lo + ROW_CHUNK].contiguous(), w)
    return out[:, :rows]


def _inner_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ_d a[..., d] · b[..., d]`` (broadcasting): the product is materialized contiguous and reduced
    over its innermost axis, so each output's summation order depends only on that axis' length."""
    return (a * b).contiguous().sum(-1)


def fixed_split_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
                          scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention whose per-query result does not depend on the batch.

    ``q [B, n, Hkv, G, D]`` (G query heads per KV head), ``keys [B, L, Hkv, D]``, ``values [B, L, Hkv, Dv]``
    with key j at absolute position j; ``query_pos [B, n]``. A key is visible to a query at p when
    j ≤ p (and j > p − ``window`` with a window). Returns ``[B, n, Hkv, G, Dv]`` in float32.
    """
    b, n, hkv, g, _ = q.shape
    length = keys.shape[1]
    q32 = q.float() * scale
    m = q32.new_full((b, n, hkv, g), float("-inf"))
    denom = q32.new_zeros((b, n, hkv, g))
    acc = q32.new_zeros((b, n, hkv, g, values.shape[-1]))
    pos = query_pos.view(b, n, 1, 1, 1)
    last = int(query_pos.max()) + 1  # splits past every query's last visible key would change nothing
    for lo in range(0, min(length, last), KEY_SPLIT):
        k = keys[:, lo:lo + KEY_SPLIT].float()
        v = values[:, lo:lo + KEY_SPLIT].float()
        if k.shape[1] < KEY_SPLIT:  # the split always has KEY_SPLIT positions: the reductions keep one shape
            pad = KEY_SPLIT - k.shape[1]
            k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
        # scores [B, n, Hkv, G, S]
        scores = _inner_dot(q32.unsqueeze(-2), k.permute(0, 2, 1, 3)[:, None, :, None])
        key_pos = torch.arange(lo, lo + KEY_SPLIT, device=q.device)
        visible = key_pos <= pos
        if window > 0:
            visible &= key_pos > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # no visible key yet
        alpha = torch.exp(m - m_safe)
        p = torch.exp(scores - m_safe.unsqueeze(-1))
        denom = denom * alpha + p.contiguous().sum(-1)
        # Σ_s p[s]·v[s] as an innermost-axis reduction: v laid out [B, 1, Hkv, 1, Dv, S]
        pv = _inner_dot(p.unsqueeze(-2), v.permute(0, 2, 3, 1)[:, None, :, None])
        acc = acc * alpha.unsqueeze(-1) + pv
        m = m_new
    return acc / denom.unsqueeze(-1)


def _request_keys(cache: torch.Tensor, table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Positions ``[0, length)`` of a request from a paged cache ``[blocks, block_size, ...]``."""
    blocks = cache.index_select(0, table[: -(-length // block_size)])
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def _decode_keys(cache: torch.Tensor, ctx: ForwardContext, rows: int) -> torch.Tensor:
    """``[rows, L, ...]`` keys of the first ``rows`` requests, padded to the longest (padding is masked)."""
    length = max(ctx.seq_lens_host[:rows])
    table = ctx.block_tables[:rows, : -(-length // ctx.block_size)]
    blocks = cache.index_select(0, table.reshape(-1))
    return blocks.view(rows, -1, *cache.shape[2:])


class BatchInvariantGemmBackend(TorchGemmBackend):
    """Op ``linear`` as ``chunked_linear`` (weights laid out as the reference lays them)."""

    name = "batch_invariant"
    priority = _PRIORITY
    capabilities = _CAPS
    traceable = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return chunked_linear(x, weight, bias)


class BatchInvariantAttentionBackend:
    """Op ``paged_attention`` with ``fixed_split_attention`` for every query row."""

    name = "batch_invariant"
    priority = _PRIORITY
    ops = frozenset({"paged_attention"})
    capabilities = _CAPS

    def available(self) -> bool:
        return True

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext, *,
                        scale: float, window: int = 0) -> torch.Tensor:
        write_kv(k, v, kv_cache, ctx.slot_mapping)
        hq, d = q.shape[1], q.shape[2]
        hkv = k.shape[1]
        grouped = q.view(q.shape[0], hkv, hq // hkv, d)
        out = torch.empty_like(q)
        nd = ctx.num_decodes
        if nd:
            keys, values = _decode_keys(kv_cache[0], ctx, nd), _decode_keys(kv_cache[1], ctx, nd)
            pos = (ctx.seq_lens[:nd] - 1).unsqueeze(1)
            o = fixed_split_attention(grouped[:nd].unsqueeze(1), keys, values, pos, scale, window)
            out[:nd] = o.reshape(nd, hq, -1).to(q.dtype)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        for i in range(nd, len(lens)):
            lo, hi, seq_len = starts[i], starts[i + 1], lens[i]
            keys = _request_keys(kv_cache[0], ctx.block_tables[i], seq_len, ctx.block_size).unsqueeze(0)
            values = _request_keys(kv_cache[1], ctx.block_tables[i], seq_len, ctx.block_size).unsqueeze(0)
            pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device).unsqueeze(0)
            o = fixed_split_attention(grouped[lo:hi].unsqueeze(0), keys, values, pos, scale, window)
            out[lo:hi] = o.reshape(hi - lo, hq, -1).to(q.dtype)
        return out


class BatchInvariantMLABackend:
    """Op ``mla_attention`` in the weight-absorbed form for every row (the layout of
    ``reference_deepseek.TorchMLABackend``): ``q_lat = q_nope · W_UK`` per head, attention of all heads
    against the shared latent rows ``[c, k_pe]``, then ``· W_UVᵀ`` per head."""

    name = "batch_invariant_mla"
    priority = _PRIORITY
    ops = frozenset({"mla_attention"})
    capabilities = _CAPS

    def available(self) -> bool:
        return True

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      cache: tuple[torch.Tensor, ...], ctx: ForwardContext, *, kv_b_weight: torch.Tensor,
                      scale: float) -> torch.Tensor:
        rows = cache[0]
        rows.view(-1, rows.shape[-1]).index_copy_(0, ctx.slot_mapping, torch.cat([latent, k_pe], dim=-1))
        heads, nope = q_nope.shape[1], q_nope.shape[2]
        per_head = kv_b_weight.unflatten(0, (heads, -1))  # [H, N+V, C]
        w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
        latent_dim = w_uk.shape[2]
        q_lat = chunked_bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, C]
        query = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, C+R]: one KV head, H query heads
        o = torch.empty(query.shape[0], heads, latent_dim, dtype=torch.float32, device=query.device)
        nd = ctx.num_decodes
        if nd:
            keys = _decode_keys(rows, ctx, nd).unsqueeze(2)  # [nd, L, 1, C+R]
            pos = (ctx.seq_lens[:nd] - 1).unsqueeze(1)
            o[:nd] = fixed_split_attention(query[:nd, None, None], keys, keys[..., :latent_dim], pos,
                                           scale).reshape(nd, heads, -1)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        for i in range(nd, len(lens)):
            lo, hi, seq_len = starts[i], starts[i + 1], lens[i]
            keys = _request_keys(rows, ctx.block_tables[i], seq_len, ctx.block_size)[None, :, None]
            pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device).unsqueeze(0)
            o[lo:hi] = fixed_split_attention(query[None, lo:hi, None], keys, keys[..., :latent_dim], pos,
                                             scale).reshape(hi - lo, heads, -1)
        out = chunked_bmm(o.to(q_nope.dtype).transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, V]
        return out.transpose(0, 1)


class BatchInvariantMoEBackend:
    """Op ``experts`` as the reference computes it, with every expert GEMM through ``chunked_linear``."""

    name = "batch_invariant"
    priority = _PRIORITY
    ops = frozenset({"experts"})
    capabilities = _CAPS

    def available(self) -> bool:
        return True

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                weights: tuple[torch.Tensor, torch.Tensor], *, swiglu_limit: float | None = None) -> torch.Tensor:
        """Same contract as ``TorchMoEBackend.experts``. A token's expert outputs are added in
        ascending expert id (``index_add_`` in index order), so the sum's order is the token's own."""
        return sorted_experts(x, topk_ids, topk_weights, weights, swiglu_limit, chunked_linear)
