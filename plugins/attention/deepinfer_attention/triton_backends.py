"""``triton`` (op ``paged_attention``) and ``triton_mla`` (op ``mla_attention``): paged attention for the
GPU whose short query rows run through this package's Triton kernels.

Per step each backend writes the step's cache rows, then splits the batch (``plan_rows``):
- a decode-only batch (every request one query token) goes to the kernel whole, without reading any
  host list: this is the path a CUDA graph captures;
- requests with at most ``max_query_len`` query tokens (speculative verification) also go to the
  kernel; their token → request map is computed on the device from ``query_start_loc``;
- a step with longer requests (prefill chunks): ``triton`` answers all its requests with its prefill kernel
  (``triton_prefill.py``) in one launch, ``triton_mla`` answers the long ones with the core's torch reference
  backend on one sub-batch and the others with its kernel; both are planned from the host lists (such a step is
  never captured whole).

``available()`` needs ``import triton`` and either CUDA or ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, used by the tests: slow, only meant to check the kernels' logic). Under the interpreter
the backends also declare the CPU device, with a priority below the torch reference, so ``auto`` keeps
the reference on CPU and the kernels run only when named.

Both read an FP8 cache (``cache.kv_dtype: fp8``, ``deepinfer/kv/fp8.py``): the write quantizes in one Triton
launch per cache tensor (``fp8_store.py``, the same bytes as the core's torch write), and the kernels
dequantize each tile after loading (``triton_mla``'s prefill chunks: in the torch reference).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from dataclasses import dataclass

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.ops import ALL_KV_DTYPES, TorchMLABackend, to_device, write_kv, write_latent
from deepinfer.testing import triton_interpreting

_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
# kernels.attention: auto takes the highest priority that fits; the core's torch backends are 0.
_GPU_PRIORITY = 20
_INTERPRETER_PRIORITY = -1


def triton_usable() -> bool:
    """``import triton`` would work and there is a device for it (CUDA, or the interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or triton_interpreting()


def _capabilities() -> BackendCapabilities:
    devices = frozenset({"cuda", "cpu"}) if triton_interpreting() else frozenset({"cuda"})
    return BackendCapabilities(devices=devices, dtypes=_DTYPES, kv_dtypes=ALL_KV_DTYPES, graph_safe=True, varlen=True)


@dataclass(frozen=True)
class RowPlan:
    """How a step's query tokens are answered.

    ``kernel_tokens``: indices of the tokens the kernel answers (``None``: all of them);
    ``token_req``: the request of each kernel token (``None``: token ``t`` is request ``t``, a
    decode-only batch); ``long_requests`` and ``long_tokens``: the requests (and their tokens) left to
    the prefill path."""

    kernel_tokens: torch.Tensor | None
    token_req: torch.Tensor | None
    long_requests: tuple[int, ...] = ()
    long_tokens: torch.Tensor | None = None


def device_token_req(ctx: ForwardContext, num_tokens: int) -> torch.Tensor:
    """Each token's request, from ``query_start_loc`` on the device (requests without query tokens,
    such as a CUDA graph's padding, are skipped naturally)."""
    tokens = torch.arange(num_tokens, dtype=ctx.query_start_loc.dtype, device=ctx.query_start_loc.device)
    return torch.searchsorted(ctx.query_start_loc, tokens, right=True) - 1


def plan_rows(ctx: ForwardContext, num_tokens: int, max_query_len: int) -> RowPlan:
    """Split a step's rows between the kernel (requests of ≤ ``max_query_len`` query tokens) and the
    reference (longer ones). When the context states a bound (``ctx.max_query_len``, set for CUDA-graph
    replays, whose host lists are the capture's) within ``max_query_len``, or every row is a decode
    row, no host list is read."""
    batch = ctx.block_tables.shape[0]
    stated = ctx.max_query_len
    if stated == 1 or (not stated and ctx.num_decodes == batch):
        return RowPlan(None, None)
    if 0 < stated <= max_query_len:
        return RowPlan(None, device_token_req(ctx, num_tokens))
    plan = _host_plan(tuple(ctx.query_start_loc_host[:batch + 1]), max_query_len, ctx.positions.device)
    return plan if plan is not None else RowPlan(None, device_token_req(ctx, num_tokens))


@functools.lru_cache(maxsize=64)
def _host_plan(starts: tuple[int, ...], max_query_len: int, device: torch.device) -> RowPlan | None:
    """``plan_rows`` from the query starts of a step with requests longer than ``max_query_len`` (None:
    there are none). Cached: every layer of a step asks for the same plan, and its index tensors are never
    written (a step with prompt rows paid ~4 host → device copies per layer for them)."""
    batch = len(starts) - 1
    lengths = [starts[i + 1] - starts[i] for i in range(batch)]
    long = tuple(i for i, n in enumerate(lengths) if n > max_query_len)
    if not long:
        return None
    short = [i for i in range(batch) if lengths[i] <= max_query_len]

    def tensor(values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, device)  # never waits for the device (the launch path)

    return RowPlan(kernel_tokens=tensor([t for i in short for t in range(starts[i], starts[i + 1])]),
                   token_req=tensor([i for i in short for _ in range(lengths[i])]),
                   long_requests=long,
                   long_tokens=tensor([t for i in long for t in range(starts[i], starts[i + 1])]))


def sub_context(ctx: ForwardContext, requests: tuple[int, ...], tokens: torch.Tensor) -> ForwardContext:
    """``ctx`` restricted to ``requests`` (none of them a decode row), whose query tokens are ``tokens``."""
    lengths = [ctx.query_start_loc_host[i + 1] - ctx.query_start_loc_host[i] for i in requests]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    rows = to_device(list(requests), torch.int64, ctx.positions.device)

    def pick(host: list | None) -> list | None:
        return None if host is None else [host[i] for i in requests]

    return dataclasses.replace(
        ctx,
        positions=ctx.positions.index_select(0, tokens),
        slot_mapping=ctx.slot_mapping.index_select(0, tokens),
        query_start_loc=to_device(starts, ctx.query_start_loc.dtype, ctx.positions.device),
        seq_lens=ctx.seq_lens.index_select(0, rows),
        block_tables=ctx.block_tables.index_select(0, rows),
        num_decodes=0,
        query_start_loc_host=starts,
        seq_lens_host=pick(ctx.seq_lens_host),
        max_query_len=max(lengths),
        state_slots=None if ctx.state_slots is None else ctx.state_slots.index_select(0, rows),
        state_slots_host=pick(ctx.state_slots_host),
        write_floor_host=pick(ctx.write_floor_host),
        visibility_floor=None if ctx.visibility_floor is None else ctx.visibility_floor.index_select(0, rows),
        visibility_floor_host=pick(ctx.visibility_floor_host),
        truncation_floor_host=pick(ctx.truncation_floor_host),
        truncation_compact_host=pick(ctx.truncation_compact_host),
    )


def reference_mla_rows(reference: TorchMLABackend, out: torch.Tensor, plan: RowPlan, q_nope: torch.Tensor,
                       q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, cache: tuple[torch.Tensor, ...],
                       ctx: ForwardContext, *, kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
    """Answer ``plan``'s long rows (prefill chunks) of an ``mla_attention`` call with the torch
    ``reference`` on one sub-batch, into ``out [T, H, V]``, which is returned."""
    lt = plan.long_tokens
    assert lt is not None
    # The reference writes these rows' cache entries again (the same values) before attending.
    long = reference.mla_attention(q_nope.index_select(0, lt), q_pe.index_select(0, lt), latent.index_select(0, lt),
                                   k_pe.index_select(0, lt), cache, sub_context(ctx, plan.long_requests, lt),
                                   kv_b_weight=kv_b_weight, scale=scale)
    out.index_copy_(0, lt, long)
    return out


class _TritonBackend:
    """What the Triton backends share: the kernels answer rows of at most ``max_query_len`` query
    tokens; priority and capabilities follow the interpreter (module docstring)."""

    def __init__(self, *, max_query_len: int = 16) -> None:
        self.max_query_len = max_query_len
        self.priority = _INTERPRETER_PRIORITY if triton_interpreting() else _GPU_PRIORITY
        self.capabilities = _capabilities()

    def available(self) -> bool:
        return triton_usable()


class TritonAttentionBackend(_TritonBackend):
    """Op ``paged_attention`` (GQA, optional sliding window) through ``triton_decode.paged_gqa_attention``
    for steps whose requests bring at most ``max_query_len`` query tokens each and through
    ``triton_prefill.paged_prefill_attention`` for steps with longer ones (prefill chunks), every row of them."""

    name = "triton"
    ops = frozenset({"paged_attention"})

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, ...], ctx: ForwardContext, *,
                        scale: float, window: int = 0) -> torch.Tensor:
        """The ``AttentionBackend`` contract (``deepinfer/interfaces.py``); an FP8 ``kv_cache`` is
        ``(k, v, k_scales, v_scales)``."""
        from deepinfer_attention.fp8_store import store_kv  # imports triton
        from deepinfer_attention.triton_decode import paged_gqa_attention
        from deepinfer_attention.triton_prefill import paged_prefill_attention

        (store_kv if len(kv_cache) == 4 else write_kv)(k, v, kv_cache, ctx.slot_mapping)
        plan = plan_rows(ctx, q.shape[0], self.max_query_len)
        k_cache, v_cache = kv_cache[:2]
        k_scales, v_scales = kv_cache[2:] if len(kv_cache) == 4 else (None, None)
        floor = ctx.visibility_floor if window > 0 else None  # bounded replay; [B], indexed by request
        if plan.long_tokens is None:
            return paged_gqa_attention(q, k_cache, v_cache, ctx.block_tables, ctx.positions, plan.token_req,
                                       scale=scale, window=window, visibility_floor=floor, k_scales=k_scales,
                                       v_scales=v_scales)
        # A step with prefill chunks: every request through the prefill kernel, tiles listed from the host lists
        # (one launch; a decode or verification row is a tile of its own). Such a step is never captured whole:
        # the piecewise graphs (engine/piecewise.py) call this eagerly between their pieces.
        return paged_prefill_attention(q, k_cache, v_cache, ctx.block_tables, ctx.positions, ctx.query_start_loc_host,
                                       range(ctx.block_tables.shape[0]), scale=scale, window=window,
                                       visibility_floor=floor, k_scales=k_scales, v_scales=v_scales)


class TritonMLABackend(_TritonBackend):
    """Op ``mla_attention`` in the weight-absorbed form through ``triton_mla.paged_mla_attention`` for
    rows of at most ``max_query_len`` query tokens (decode and verification alike, so both see the same
    arithmetic); longer rows through ``TorchMLABackend``."""

    name = "triton_mla"
    ops = frozenset({"mla_attention"})

    def __init__(self, *, max_query_len: int = 16) -> None:
        super().__init__(max_query_len=max_query_len)
        self._reference = TorchMLABackend()

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      cache: tuple[torch.Tensor, ...], ctx: ForwardContext, *, kv_b_weight: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """The ``TorchMLABackend.mla_attention`` contract: ``q_nope [T, H, N]``, ``q_pe [T, H, R]``,
        ``latent [T, C]``, ``k_pe [T, R]``, ``cache = ([blocks, block_size, C + R],)`` (FP8: ``(rows,
        scales)``), ``kv_b_weight [H·(N+V), C]``; returns ``[T, H, V]``."""
        from deepinfer_attention.fp8_store import store_latent  # imports triton
        from deepinfer_attention.triton_mla import paged_mla_attention

        (store_latent if len(cache) == 2 else write_latent)(latent, k_pe, cache, ctx.slot_mapping)
        rows, scales = cache[0], (cache[1] if len(cache) == 2 else None)
        heads, nope = q_nope.shape[1], q_nope.shape[2]
        per_head = kv_b_weight.unflatten(0, (heads, -1))  # [H, N+V, C]
        w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]

        def absorbed(qn: torch.Tensor, qp: torch.Tensor, positions: torch.Tensor,
                     token_req: torch.Tensor | None) -> torch.Tensor:
            q_lat = torch.bmm(qn.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, C]
            o = paged_mla_attention(q_lat, qp, rows, ctx.block_tables, positions, token_req, scale=scale,
                                    scales=scales)
            return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [n, H, V]

        plan = plan_rows(ctx, q_nope.shape[0], self.max_query_len)
        if plan.long_tokens is None:
            return absorbed(q_nope, q_pe, ctx.positions, plan.token_req)
        assert plan.kernel_tokens is not None
        out = q_nope.new_empty(q_nope.shape[0], heads, w_uv.shape[1])
        kt = plan.kernel_tokens
        if kt.numel():
            out.index_copy_(0, kt, absorbed(q_nope.index_select(0, kt), q_pe.index_select(0, kt),
                                            ctx.positions.index_select(0, kt), plan.token_req))
        return reference_mla_rows(self._reference, out, plan, q_nope, q_pe, latent, k_pe, cache, ctx,
                                  kv_b_weight=kv_b_weight, scale=scale)
