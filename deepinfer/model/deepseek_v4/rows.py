"""How a DeepSeek-V4 step's rows reach the layers: per-request segments (host ints), device-addressed
rows (``device_rows``: decode and verification steps, which CUDA graphs capture), and the YoCo consumers'
view of a truncated prefill step (``_consumer_view``, reference/deepinfer.md §6)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch

from deepinfer.interfaces import ForwardContext
from deepinfer.model.transfer import to_device


@dataclass(frozen=True)
class _Segment:
    """One request's rows ``[lo, hi)`` of the step, computing positions ``[start, end)``."""

    lo: int
    hi: int
    start: int
    end: int
    slot: int
    floor: int
    index: int


def _segments(ctx: ForwardContext) -> list[_Segment]:
    if ctx.state_slots_host is None:
        raise RuntimeError("DeepseekV4ForCausalLM keeps per-request state: ctx.state_slots_host must be set "
                           "(the engine sets it for models whose cache specs have state slots)")
    starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
    floors = ctx.write_floor_host or [0] * len(lens)
    return [_Segment(starts[i], starts[i + 1], lens[i] - (starts[i + 1] - starts[i]), lens[i],
                     ctx.state_slots_host[i], floors[i], i) for i in range(len(lens))]


def device_rows(ctx: ForwardContext, max_query_len: int) -> bool:
    """Whether the compressors update on device tensors only (``Compressor._update_rows``): every request
    of the step brings at most ``max_query_len`` query tokens — as ``ctx.max_query_len`` states (a CUDA
    graph replay states its bucket's bound) or as decode rows do — and none rebuilds state below its
    write floor or is YoCo-truncated. Host values only; a graph replay's host lists are the capture's
    one-token requests, which pass (the runner replays no step that rebuilds state or truncates)."""
    if not (0 < ctx.max_query_len <= max_query_len or ctx.num_decodes == ctx.block_tables.shape[0]):
        return False
    if ctx.truncation_floor_host is not None:
        return False
    floors, starts = ctx.write_floor_host, ctx.query_start_loc_host
    return floors is None or all(f <= n - (starts[i + 1] - starts[i])
                                 for i, (f, n) in enumerate(zip(floors, ctx.seq_lens_host, strict=True)))


@dataclass(frozen=True)
class _DeviceRows:
    """A step's query tokens addressed on the device, for compressors that update without host lists
    (``device_rows``): ``requests [T]`` each token's request (its row of ``ctx.block_tables``) and
    ``slots [T]`` that request's state slot."""

    requests: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def of(cls, ctx: ForwardContext) -> _DeviceRows:
        """From ``query_start_loc`` on the device (requests without query tokens, such as those after a
        graph's padding, get none); in a step of decode rows token t is request t."""
        assert ctx.state_slots is not None, "a stateful step needs ctx.state_slots"
        dev, tokens = ctx.positions.device, ctx.positions.shape[0]
        if ctx.max_query_len == 1 or ctx.num_decodes == ctx.block_tables.shape[0]:
            return cls(torch.arange(tokens, device=dev), ctx.state_slots)
        starts = ctx.query_start_loc
        requests = torch.searchsorted(starts, torch.arange(tokens, dtype=starts.dtype, device=dev), right=True) - 1
        return cls(requests, ctx.state_slots.index_select(0, requests))


StepRows = Sequence[_Segment] | _DeviceRows
"""How a step's rows reach the compressors: per-request segments (host ints), or ``_DeviceRows``."""


def layer_stance(step_rows: StepRows) -> AbstractContextManager[object]:
    """Where the layers run when compiled (``kernels.compile``): steps on device rows through the compiled
    layers; steps planned request by request (prefill chunks, replays) through the plain ones, since their
    host loops would recompile the layers for every new step shape (and past Dynamo's recompile limit fall
    back to eager anyway)."""
    return nullcontext() if isinstance(step_rows, _DeviceRows) else torch.compiler.set_stance("force_eager")


@dataclass(frozen=True)
class _ConsumerView:
    """What the YoCo consumer layers compute under prefill truncation (reference/deepinfer.md §6): the
    step's ``ctx``, ``segments``, ``positions`` and ``input_ids`` restricted to ``rows`` (None: every row,
    mask mode), with each request's truncation floor as its visibility floor."""

    ctx: ForwardContext
    segments: list[_Segment]
    positions: torch.Tensor
    input_ids: torch.Tensor
    rows: torch.Tensor | None


def _consumer_view(ctx: ForwardContext, segments: Sequence[_Segment], input_ids: torch.Tensor) -> _ConsumerView:
    """The consumer layers' view of a step with ``ctx.truncation_floor_host`` set. A compact request keeps
    its rows from its floor on (a chunk wholly below it keeps its last row as a placeholder, whose window
    is then just itself); a mask request keeps every row."""
    assert ctx.truncation_floor_host is not None and ctx.truncation_compact_host is not None
    restore = ctx.visibility_floor_host or [0] * len(segments)
    floors = [max(a, b) for a, b in zip(restore, ctx.truncation_floor_host, strict=True)]
    dev = ctx.positions.device
    floor_tensor = to_device(floors, torch.int64, dev)
    if not any(ctx.truncation_compact_host):
        narrowed = replace(ctx, visibility_floor_host=floors, visibility_floor=floor_tensor)
        return _ConsumerView(narrowed, list(segments), ctx.positions, input_ids, None)
    kept: list[torch.Tensor] = []
    starts, compact = [0], []
    for s, floor, drop in zip(segments, floors, ctx.truncation_compact_host, strict=True):
        clip = min(max(floor - s.start, 0), s.hi - s.lo - 1) if drop else 0
        kept.append(torch.arange(s.lo + clip, s.hi, device=dev))
        compact.append(replace(s, lo=starts[-1], hi=starts[-1] + s.hi - s.lo - clip, start=s.start + clip))
        starts.append(compact[-1].hi)
    rows = torch.cat(kept)
    narrowed = replace(ctx, positions=ctx.positions[rows], slot_mapping=ctx.slot_mapping[rows],
                       query_start_loc=to_device(starts, ctx.query_start_loc.dtype, dev),
                       query_start_loc_host=starts, visibility_floor_host=floors, visibility_floor=floor_tensor)
    return _ConsumerView(narrowed, compact, narrowed.positions, input_ids[rows], rows)



def _all_rows(rows: torch.Tensor, num_tokens: int, view: _ConsumerView | None) -> torch.Tensor:
    """``rows`` of the step's tokens; under compact YoCo truncation only ``view.rows`` were computed and
    the others come back as zeros (never sampled, and below every later query's window)."""
    if view is None or view.rows is None:
        return rows
    return rows.new_zeros(num_tokens, rows.shape[1]).index_copy_(0, view.rows, rows)
