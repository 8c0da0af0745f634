"""``cpu_paged`` (op ``paged_attention``): short query rows answered straight from the paged cache.

The core's reference backend answers a decode row by gathering the request's whole blocks into a
padded ``[batch, longest context, kv heads, dim]`` copy and running a masked SDPA over it: every key and
value is read, written and read again, and at batch 32 on SmolLM2 that was 160 of a 250 ms decode step
(docs/benchmarks.md, issue 36). ``csrc/paged_attention.c`` reads each (request, KV head)'s keys and values
once through the block table for every query row of the request and all the query heads of its GQA group,
one OpenMP task per pair, with ``torch.get_num_threads()`` threads. The same call first stores the step's own keys and
values at their cache slots (in place of the core's ``write_kv``: one C call per layer instead of three).

Steps whose every request has at most ``MAX_QUERY_ROWS`` query rows take the kernel: decode rows,
speculative verification rows (1 + drafts), short prompt chunks, in any mix; on a cache it scores through
the AMX tiles also prompt chunks of up to ``MAX_CHUNK_ROWS`` rows (``kernel_takes``), whose value sums go
through the tiles too (their weights rounded to bf16, as SDPA's flash kernel rounds them). A step with a
longer chunk goes whole to the core's ``TorchAttentionBackend`` (long prefill is GEMM-bound; its attention is
the reference's causal SDPA). The kernel equals the reference within float32 rounding (the order of the
sums). float32 and bfloat16 models with plain caches (its capabilities; a bf16 cache is read as float32,
queries and sums are float32, the output is rounded to bf16 once; on a CPU with AMX tiles a bf16 cache's
scores go through the tiles, which round the queries to bf16 — exact for a bf16 model's queries); an
FP8-cache run keeps the core's backend.

The kernel is compiled on first use with the system C compiler (``FLAGS``) into ``<deepinfer
cache>/cpu_kernels/`` under a name hashed from the source, the flags and the compiler, so a machine
builds it once (under a second); ``available()`` is False without a compiler, and a failed build raises
with the compiler's message.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.ops import TorchAttentionBackend
from deepinfer_cpu.cbuild import CSRC, FLAGS, build_library, compiler

__all__ = ["FLAGS", "MAX_CHUNK_ROWS", "MAX_QUERY_ROWS", "CPUPagedAttentionBackend", "as_int64", "compiler",
           "kernel_takes", "load_kernel",
           "paged_attention"]

SOURCE = CSRC / "paged_attention.c"
# Query rows per request the kernel takes in one task (a verification step's 1 + max_draft, short prompts); its
# score buffer holds rows × group × context floats per task.
MAX_QUERY_ROWS = 16
# Query rows per request the kernel takes at most on a cache it scores through the AMX tiles (``tiles``), in tasks
# of MAX_QUERY_ROWS: a 128-row bf16 prompt's attention 0.17 ms a SmolLM2 layer against the core's SDPA path's ~0.3;
# at 512 rows SDPA's flash kernel leads (0.97 against 1.27 ms: docs/benchmarks.md).
MAX_CHUNK_ROWS = 256


@functools.cache
def load_kernel(march: str = "native") -> ctypes.CDLL:
    """The compiled kernel library, built into the cache on first use (``march``: ``cbuild.build_library``)."""
    lib = build_library(SOURCE, march)
    i64, f32 = ctypes.c_int64, ctypes.c_float
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention.argtypes = ([ctypes.c_void_p] * 8 + [i64] * 7 + [f32, ctypes.c_int]
                                    + [ctypes.c_void_p] * 3 + [i64, ctypes.c_int])
    lib.paged_attention_tiles.restype = ctypes.c_int
    lib.paged_attention_tiles.argtypes = [ctypes.c_int, i64, i64, i64]
    return lib


@functools.cache
def tiles(cache_dtype: torch.dtype, window: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel scores such a cache through the AMX tiles (a bf16 cache on a CPU with AMX-BF16, no window,
    heads of 64 or 128, blocks of a multiple of 16)."""
    return bool(load_kernel().paged_attention_tiles(int(cache_dtype == torch.bfloat16), window, head_dim, block_size))


def kernel_takes(max_query_len: int, cache_dtype: torch.dtype, window: int, head_dim: int, block_size: int) -> bool:
    """Whether a step whose requests bring at most ``max_query_len`` rows each goes to the kernel: up to
    ``MAX_QUERY_ROWS`` (0, not stated, too, as before), and up to ``MAX_CHUNK_ROWS`` on a cache it scores through
    the tiles."""
    return max_query_len <= MAX_QUERY_ROWS or (
        max_query_len <= MAX_CHUNK_ROWS and tiles(cache_dtype, window, head_dim, block_size))


@functools.cache
def _paged_attention() -> ctypes._CFuncPtr:
    return load_kernel().paged_attention


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # checked first: a call per layer each (a decode step pays per torch op, issue 36)
    return t if t.is_contiguous() else t.contiguous()


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int64 tensor (itself when it already is one: the engine's index tensors)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_starts: torch.Tensor, *, scale: float, window: int = 0,
                    floors: torch.Tensor | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``q [T, Hq, D]``: request r's rows ``query_starts[r] : query_starts[r + 1]`` are its last tokens (its
    keys up to ``seq_lens[r]`` already in the cache), against the paged ``k_cache, v_cache [blocks,
    block_size, Hkv, D]``; every tensor on the CPU, the caches float32 or bfloat16, ``q`` float32 or the
    caches' dtype (the kernel computes in float32). ``new_kv = (k, v [T, Hkv, D], slot_mapping [T])``: the
    step's keys and values (the caches' dtype), stored at their flat cache slots first (in the same C call).
    Returns ``[T, Hq, D]`` in ``q``'s dtype."""
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
    assert q.dtype in (torch.float32, k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    out_dtype = q.dtype
    q = _contiguous(q.float())
    tables, lens, starts = as_int64(block_tables), as_int64(seq_lens), as_int64(query_starts)
    floor_arg = None
    if floors is not None:
        floors = as_int64(floors)
        floor_arg = floors.data_ptr()
    new_k = new_v = slots = None
    new_tokens = 0
    if new_kv is not None:
        new_k, new_v, slots = new_kv
        assert new_k.dtype == new_v.dtype == k_cache.dtype
        new_k, new_v, slots = _contiguous(new_k), _contiguous(new_v), as_int64(slots)
        new_tokens = slots.shape[0]
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    failed = _paged_attention()(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), starts.data_ptr(),
        floor_arg, out.data_ptr(), lens.shape[0], heads, k_cache.shape[2], dim, k_cache.shape[1], tables.shape[1],
        window, scale, torch.get_num_threads(), None if new_k is None else new_k.data_ptr(),
        None if new_v is None else new_v.data_ptr(), None if slots is None else slots.data_ptr(), new_tokens,
        int(k_cache.dtype == torch.bfloat16))
    if failed:
        raise MemoryError("cpu_paged attention: the kernel could not allocate its score buffer")
    return out.to(out_dtype)


class CPUPagedAttentionBackend:
    """Op ``paged_attention`` on CPU: steps of short query rows through ``paged_attention``, steps with a
    long prompt chunk through the core's reference backend (module docstring)."""

    name = "cpu_paged"
    priority = 10  # above the core's torch backend (0) on CPU runs with the plugin enabled
    ops = frozenset({"paged_attention"})
    capabilities = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32, torch.bfloat16}),
                                       varlen=True)

    def __init__(self) -> None:
        self.reference = TorchAttentionBackend()

    def available(self) -> bool:
        return compiler() is not None

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, ...], ctx: ForwardContext, *,
                        scale: float, window: int = 0) -> torch.Tensor:
        """The ``AttentionBackend`` contract (``deepinfer/interfaces.py``)."""
        if not kernel_takes(ctx.max_query_len, kv_cache[0].dtype, window, q.shape[-1], kv_cache[0].shape[1]):
            return self.reference.paged_attention(q, k, v, kv_cache, ctx, scale=scale, window=window)
        return paged_attention(q, kv_cache[0], kv_cache[1], ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                               scale=scale, window=window, floors=ctx.visibility_floor if window > 0 else None,
                               new_kv=(k, v, ctx.slot_mapping))
