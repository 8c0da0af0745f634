"""``flash_mla`` (op ``mla_attention``): decode rows through FlashMLA 1.0's sparse decode kernel on
Blackwell. **Untested**: written against the API that reference/kernels.md §4 documents (package
``deepinfer-flashmla`` 1.0.0, import ``flash_mla``); this machine has neither an SM100 GPU nor the package.

FlashMLA 1.0 runs only on compute capability 10.x and keeps only the sparse, FP8 path of
``flash_mla_with_kvcache``: ``q [B, s_q, h_q, 512]`` bf16 with ``h_q`` 64 or 128, a paged cache
``[pages, page_size, 1, 528]`` of 512 e4m3 values per token followed by 16 UE8M0 scales (one per 32
values), and ``indices [B, s_q, topk]`` int32 naming the keys of each query (``page · page_size + offset``,
−1 = none; ``block_table`` and ``cache_seqlens`` are ignored, ``causal`` must be False). It returns
``(out [B, s_q, h_q, 512] bf16, lse)``, where out is the softmax-weighted sum of the 512-dim tokens.

Our latent cache holds one bf16 row ``[c | k_pe]`` of ``C + R`` dims per token (``PagedLatentSpec``); in the
weight-absorbed form a head's query is ``[q_nope · W_UK | q_pe]`` against those rows and its value is ``c``,
the first ``C`` dims of the same row. So the layouts agree when ``C + R = 512``: each kernel row is one
FlashMLA query (``s_q = 1``) whose indices list its request's positions ``≤ p``, the request's cache blocks
are packed into FlashMLA's FP8 token format on every call (the packed copy is ``[B · width, block_size, 1,
528]``, pages numbered request by request, so any block size works), and the output's first ``C`` dims go
through ``W_UV``. Everything else is refused with an error naming it: DeepSeek-V2/V3 rows are 576 dims
(``kv_lora_rank`` 512 + rope 64), a layout FlashMLA 1.0 dropped (``triton_mla`` serves them); more than 128
heads; a dtype other than bf16. Prefill chunks (more than ``max_query_len`` query tokens) go to the core's
``TorchMLABackend``, as in ``triton_mla``.

The FP8 packing costs a pass over each request's cache per layer and rounds keys and values to e4m3, so
this adapter is neither a speed-up nor bitwise the bf16 reference; a cache kept in FlashMLA's format would
remove both (an FP8 latent cache of that layout is not in the engine).
"""

from __future__ import annotations

import importlib

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.ops import TorchMLABackend
from deepinfer_attention.triton_backends import plan_rows, reference_mla_rows

TOKEN_DIMS = 512  # FlashMLA 1.0's query/key width
SCALE_GROUP = 32  # values per UE8M0 scale
TOKEN_BYTES = TOKEN_DIMS + TOKEN_DIMS // SCALE_GROUP  # 528
HEAD_COUNTS = (64, 128)  # the kernel's query head counts; fewer heads are zero-padded
TOPK_ALIGN = 64  # indices padded with -1 to a multiple of this (the doc states no constraint; a tile-friendly shape)
E4M3_MAX = 448.0
# auto prefers triton_mla (20): this adapter is untested and repacks the cache per call. Name it to use it.
PRIORITY = 10


def flash_mla_usable() -> bool:
    """A CUDA device of compute capability 10.x (Blackwell: FlashMLA 1.0 has no other kernels) and
    ``import flash_mla`` works."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        return False
    try:
        importlib.import_module("flash_mla")
    except ImportError:
        return False
    return True


def pack_fp8_tokens(rows: torch.Tensor) -> torch.Tensor:
    """``rows [..., 512]`` → FlashMLA 1.0's FP8 token bytes ``[..., 528]`` uint8: the values as e4m3 with
    one power-of-two scale per 32 (``2^⌈log2(amax / 448)⌉``), then the 16 scales as UE8M0 (exponent + 127)."""
    groups = rows.float().unflatten(-1, (-1, SCALE_GROUP))  # [..., 16, 32]
    amax = groups.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127)
    values = (groups / torch.exp2(exponent).unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = (exponent + 127).to(torch.uint8)
    return torch.cat([values.flatten(-2), scales], dim=-1)


def sparse_indices(block_tables: torch.Tensor, positions: torch.Tensor, token_req: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    """``[N, 1, topk]`` int32: for query ``t`` of request ``r = token_req[t]`` at position ``p``, the packed
    cache slots ``(r · width + j // block_size) · block_size + j % block_size`` of its keys ``j ≤ p``, then
    −1; ``topk`` is the table's ``width · block_size`` rounded up to ``TOPK_ALIGN``."""
    width = block_tables.shape[1]
    topk = -(-width * block_size // TOPK_ALIGN) * TOPK_ALIGN
    keys = torch.arange(topk, device=positions.device)
    slots = token_req[:, None] * (width * block_size) + keys[None, :]
    slots = torch.where(keys[None, :] <= positions[:, None], slots, -1)
    return slots.to(torch.int32).unsqueeze(1)


class FlashMLABackend:
    """Op ``mla_attention`` for rows of at most ``max_query_len`` query tokens through FlashMLA 1.0
    (module docstring); longer rows through ``TorchMLABackend``."""

    name = "flash_mla"
    ops = frozenset({"mla_attention"})
    priority = PRIORITY
    capabilities = BackendCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.bfloat16}),
                                       graph_safe=False, varlen=True)

    def __init__(self, *, max_query_len: int = 16) -> None:
        self.max_query_len = max_query_len
        self._reference = TorchMLABackend()
        # FlashMLA's scheduling metadata, filled by the first call of a step and reused by its other layers
        # (same shapes); keyed by the step's ForwardContext, which the runner builds once per step.
        self._step: ForwardContext | None = None
        self._metadata: object = None

    def available(self) -> bool:
        return flash_mla_usable()

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      cache: tuple[torch.Tensor, ...], ctx: ForwardContext, *, kv_b_weight: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """The ``TorchMLABackend.mla_attention`` contract: ``q_nope [T, H, N]``, ``q_pe [T, H, R]``,
        ``latent [T, C]``, ``k_pe [T, R]``, ``cache = ([blocks, block_size, C + R],)``,
        ``kv_b_weight [H·(N+V), C]``; returns ``[T, H, V]``. Raises ``ValueError`` for a layout FlashMLA 1.0
        cannot serve."""
        rows = cache[0]
        self._check(rows, q_nope.shape[1])
        rows.view(-1, rows.shape[-1]).index_copy_(0, ctx.slot_mapping, torch.cat([latent, k_pe], dim=-1))
        plan = plan_rows(ctx, q_nope.shape[0], self.max_query_len)
        if plan.long_tokens is None:
            token_req = plan.token_req if plan.token_req is not None else torch.arange(
                q_nope.shape[0], device=q_nope.device)
            return self._decode(q_nope, q_pe, rows, ctx, ctx.positions, token_req, kv_b_weight, scale)
        assert plan.kernel_tokens is not None
        heads, nope = q_nope.shape[1], q_nope.shape[2]
        out = q_nope.new_empty(q_nope.shape[0], heads, kv_b_weight.shape[0] // heads - nope)
        kt = plan.kernel_tokens
        if kt.numel():
            out.index_copy_(0, kt, self._decode(q_nope.index_select(0, kt), q_pe.index_select(0, kt), rows, ctx,
                                                ctx.positions.index_select(0, kt), plan.token_req, kv_b_weight, scale))
        return reference_mla_rows(self._reference, out, plan, q_nope, q_pe, latent, k_pe, cache, ctx,
                                  kv_b_weight=kv_b_weight, scale=scale)

    @staticmethod
    def _check(rows: torch.Tensor, heads: int) -> None:
        if rows.shape[-1] != TOKEN_DIMS:
            raise ValueError(
                f"kernels.attention 'flash_mla': FlashMLA 1.0 attends over {TOKEN_DIMS}-dim tokens, but this model's "
                f"latent cache rows are {rows.shape[-1]} dims (kv_lora_rank + qk_rope_head_dim; DeepSeek-V2/V3: "
                "512 + 64, a layout FlashMLA 1.0 dropped); use kernels.attention 'triton_mla' or 'torch_mla'")
        if heads > HEAD_COUNTS[-1]:
            raise ValueError(f"kernels.attention 'flash_mla': {heads} query heads per rank; FlashMLA 1.0 serves "
                             f"at most {HEAD_COUNTS[-1]}")
        if rows.dtype != torch.bfloat16:
            raise ValueError(f"kernels.attention 'flash_mla': the latent cache is {rows.dtype}; FlashMLA needs "
                             "bfloat16 activations (dtype: bfloat16)")

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, ctx: ForwardContext,
                positions: torch.Tensor, token_req: torch.Tensor, kv_b_weight: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Kernel rows: query ``t`` of request ``token_req[t]`` at ``positions[t]`` → ``[n, H, V]``."""
        import flash_mla

        n, heads, nope = q_nope.shape
        per_head = kv_b_weight.unflatten(0, (heads, -1))  # [H, N+V, C]
        w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
        latent_dim = w_uk.shape[2]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, C]
        padded = next(h for h in HEAD_COUNTS if h >= heads)
        q = q_nope.new_zeros(n, 1, padded, TOKEN_DIMS)
        q[:, 0, :heads] = torch.cat([q_lat, q_pe], dim=-1)
        block_size, tables = rows.shape[1], ctx.block_tables
        k_cache = pack_fp8_tokens(rows.index_select(0, tables.reshape(-1))).unsqueeze(2)  # [B·width, bs, 1, 528]
        indices = sparse_indices(tables, positions, token_req, block_size)
        if self._step is not ctx:
            self._metadata, _ = flash_mla.get_mla_metadata()
            self._step = ctx
        out, _lse = flash_mla.flash_mla_with_kvcache(
            q, k_cache, tables.index_select(0, token_req).to(torch.int32), (positions + 1).to(torch.int32),
            TOKEN_DIMS, self._metadata, None, softmax_scale=scale, causal=False, is_fp8_kvcache=True,
            indices=indices)
        o = out[:, 0, :heads, :latent_dim]  # the value is c, the first C dims of each token
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [n, H, V]
