"""Drafting on the device, right after a step's sampling (API.md §2; reference/deepinfer.md §2, §4).

The drafter runs in the device part of every speculative step, between its sampling (or verification)
and the next forward, on the step's results as they are on the device: how many drafts each request
accepted, and so its last token and position, are never read by the host first. Under an overlapped
executor the next step is then scheduled while this one runs, and its rows verify drafts the device
made (the device-side fix-up, ``engine/followup.py``); under the synchronous one the host reads the
proposal together with the step's tokens (one read).

- ``DraftPlan``: what the host knows of the drafting when it prepares the step: which sampling rows
  draft, and for each its rows, its position and room *if the step accepts none of its drafts*; the
  device adds the accepted count.
- ``TokenCache``: the token id of every computed position, in the main pool's slot of that position
  (it follows the KV cache's blocks like the dspark context cache), from which ``DraftInputs.history``
  is gathered for the drafters that read it (``ngram``, ``oracle``).
- ``draft_fields`` / ``draft_inputs``: the plan's host lists, and from them on the device the ``DraftInputs``
  (and ``CommittedRows``) of one step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from deepinfer.interfaces import CommittedRows, DraftInputs, ForwardContext
from deepinfer.model.transfer import to_device_many

SCRATCH_SLOT = 0  # state slot 0 is never handed out (kv/state.py): the per-request state of scratch rows


@dataclass(frozen=True)
class DraftPlan:
    """The drafting after one step, as the host knows it when it prepares the step.

    Per drafting request (the proposal's rows, in this order): ``samplers`` its row among the step's
    sampling rows, ``request_ids``, ``last_rows`` the step's token row of its last committed row and
    ``positions`` the position of its last token — both if the step accepts none of its drafts (the
    device adds the accepted count) —, ``rooms`` the drafts it could still use then (what it may still
    emit, less one; one fewer per accepted draft; the core keeps at most ``k``), ``coverage`` the
    positions its block table covers (a chained draft row past them runs on the scratch block),
    ``tables`` its block table, ``seeds``,
    ``temperatures`` (0: greedy) and ``state_slots`` (models with per-request state; None otherwise).

    Per token row of the step: ``next_tokens`` the token after it when the host knows it (the next
    input token; 0 where the step emits it), ``emitted_rows`` the rows whose next token the step emits
    and ``emitted_from`` where: ``(sampling row, j)``, the request's ``j``-th emitted token.
    """

    samplers: list[int]
    request_ids: list[str]
    last_rows: list[int]
    positions: list[int]
    rooms: list[int]
    coverage: list[int]
    tables: list[list[int]]
    seeds: list[int]
    temperatures: list[float]
    state_slots: list[int] | None
    next_tokens: list[int]
    emitted_rows: list[int]
    emitted_from: list[tuple[int, int]]

    @property
    def sampling(self) -> bool:
        """Whether any drafting request samples (its drafts then come with distributions)."""
        return any(t > 0 for t in self.temperatures)


class TokenCache:
    """The token id of every computed position, at the main pool's slot of that position: written by
    every step for its rows (a rejected draft's row too: that position is written again when it is
    computed for real), read back through block tables."""

    def __init__(self, num_slots: int, block_size: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.block_size = block_size

    def write(self, slot_mapping: torch.Tensor, input_ids: torch.Tensor) -> None:
        self.tokens[slot_mapping] = input_ids

    def history(self, tables: torch.Tensor, positions: torch.Tensor, last_tokens: torch.Tensor, width: int
                ) -> torch.Tensor:
        """``[B, width]``: each request's tokens up to its last one (at ``positions``, not computed yet,
        so ``last_tokens``), right-aligned, −1 before position 0."""
        cols = torch.arange(width, device=positions.device)
        at = positions.unsqueeze(1) - (width - 1) + cols
        bs = self.block_size
        slots = tables.gather(1, (at.clamp(min=0) // bs).clamp(max=tables.shape[1] - 1)) * bs + at.clamp(min=0) % bs
        history = torch.where(at >= 0, self.tokens[slots], -1)
        history[:, -1] = last_tokens
        return history


@dataclass(frozen=True)
class StepTokens:
    """A step's results as the drafting reads them, on the device: per sampling row the tokens it
    emitted ``[S, K+1]`` (−1 past them), how many drafts it accepted ``[S]`` and how far its positions
    were moved before the forward ``[S]`` (a follow-up row's fix-up, ``engine/followup.py``; None: none)."""

    emitted: torch.Tensor
    num_accepted: torch.Tensor
    moved: torch.Tensor | None = None

    def last(self) -> torch.Tensor:
        """Each sampling row's final emitted token ``[S]``."""
        return self.emitted.gather(1, self.num_accepted.unsqueeze(1)).squeeze(1)


class ChainRows:
    """``CommittedRows.chain``: one decode row per drafting request at ``positions + offset``, on the
    request's blocks where it may keep the draft that row leads to and its table covers the position;
    else on the scratch block (and scratch state slot)."""

    def __init__(self, positions: torch.Tensor, caps: torch.Tensor, coverage: torch.Tensor, tables: torch.Tensor,
                 state_slots: torch.Tensor | None, block_size: int, backends: Mapping[str, object],
                 exact_host_lists: Callable[[ForwardContext], None]) -> None:
        self.positions, self.caps, self.coverage, self.tables = positions, caps, coverage, tables
        self.state_slots = state_slots
        self.block_size = block_size
        self.backends = backends
        self.exact_host_lists = exact_host_lists
        self.used = False  # whether a drafter asked for chained rows (then their coverage caps its drafts)

    def __call__(self, offset: int) -> ForwardContext:
        self.used = True
        batch, dev, bs = self.positions.shape[0], self.positions.device, self.block_size
        wanted = self.positions + offset
        valid = (offset + 2 <= self.caps) & (wanted < self.coverage)
        positions = torch.where(valid, wanted, 0)
        tables = torch.where(valid.unsqueeze(1), self.tables, 0)
        slots = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs + positions % bs
        ctx = ForwardContext(
            positions=positions, slot_mapping=slots,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            seq_lens=positions + 1, block_tables=tables, num_decodes=batch,
            query_start_loc_host=list(range(batch + 1)), seq_lens_host=[1] * batch, block_size=bs,
            backends=self.backends, max_query_len=1)
        if self.state_slots is not None:
            ctx.state_slots = torch.where(valid, self.state_slots, SCRATCH_SLOT)
            ctx.state_slots_host = [SCRATCH_SLOT] * batch
        self.exact_host_lists(ctx)
        return ctx

    def draft_caps(self) -> torch.Tensor:
        """Drafts each request may keep given where its chained rows could land (``caps`` when the drafter
        chained no row)."""
        if not self.used:
            return self.caps
        return torch.minimum(self.caps, (self.coverage - self.positions + 1).clamp(min=1))


def draft_fields(plan: DraftPlan, *, rows: int, emitted_width: int, with_rows: bool
                 ) -> dict[str, tuple[list, torch.dtype]]:
    """The host lists ``draft_inputs`` reads, by field, ``(values, dtype)``: sent to the device in one copy per
    dtype, or packed by the speculative tail's graphs (``engine/tail_graphs.py``). ``rows``: the step's token
    rows (a graph's bucket, padding included); ``emitted_width`` the width of the step's ``[S, K+1]`` tokens;
    ``with_rows``: the drafter reads the step's rows."""
    i64 = torch.int64
    width = max((len(t) for t in plan.tables), default=1)
    fields: dict[str, tuple[list, torch.dtype]] = {
        "samplers": (plan.samplers, i64), "positions": (plan.positions, i64), "rooms": (plan.rooms, i64),
        "tables": ([[*t] + [0] * (width - len(t)) for t in plan.tables], i64), "seeds": (plan.seeds, i64),
        "temperature": (plan.temperatures, torch.float32)}
    if with_rows:
        # The step's next tokens padded to its rows, and where each emitted one is in the step's ``[S, K+1]``
        # tokens, flat (the shapes are host facts).
        fields |= {"next_tokens": ([*plan.next_tokens, *[0] * (rows - len(plan.next_tokens))], i64),
                   "emitted_rows": (plan.emitted_rows, i64),
                   "emitted_at": ([s * emitted_width + j for s, j in plan.emitted_from], i64),
                   "coverage": (plan.coverage, i64), "last_rows": (plan.last_rows, i64)}
        if plan.state_slots is not None:
            fields["state_slots"] = (plan.state_slots, i64)
    return fields


def draft_inputs(plan: DraftPlan, tokens: StepTokens, *, k: int, input_ids: torch.Tensor, ctx: ForwardContext,
                 hidden: torch.Tensor | None, token_cache: TokenCache | None, block_size: int,
                 exact_host_lists: Callable[[ForwardContext], None], sent: dict[str, torch.Tensor] | None = None
                 ) -> tuple[DraftInputs, ChainRows | None, torch.Tensor]:
    """The ``DraftInputs`` of the drafting after a step, from its plan and its results on the device.
    ``input_ids`` / ``ctx`` / ``hidden`` are the step's (a CUDA graph's static ones, padding rows included);
    ``hidden`` None: the drafter reads no rows. ``sent``: ``draft_fields``' tensors already on the device (the
    speculative tail's static buffers; ``next_tokens`` is written in place); None sends them now. Returns the
    inputs, their chain (with rows) and the drafts each request may keep ``[B]`` (what it may still use, at
    most ``k``; the chain may lower it)."""
    if sent is None and not plan.samplers:
        return _rows_only_inputs(plan, tokens, k=k, input_ids=input_ids, ctx=ctx, hidden=hidden, block_size=block_size,
                                 exact_host_lists=exact_host_lists)
    if sent is None:
        fields = draft_fields(plan, rows=input_ids.shape[0], emitted_width=tokens.emitted.shape[1],
                              with_rows=hidden is not None)
        sent = dict(zip(fields, to_device_many(list(fields.values()), input_ids.device), strict=True))
    batch = len(plan.samplers)
    samplers = sent["samplers"]
    accepted = tokens.num_accepted.index_select(0, samplers)
    last_tokens = tokens.last().index_select(0, samplers)
    # The plan's positions and rooms hold for a row as laid out and a step that accepts no draft.
    shift = accepted if tokens.moved is None else accepted + tokens.moved.index_select(0, samplers)
    positions = sent["positions"] + shift
    caps = (sent["rooms"] - shift).clamp(min=0, max=k)
    tables = sent["tables"].reshape(batch, -1) if batch else sent["tables"].reshape(0, 1)  # [B, table width]
    rows = chain = None
    if hidden is not None:
        next_tokens = sent["next_tokens"]  # a view of this step's own copy: written in place
        emitted = (sent["emitted_rows"], sent["emitted_at"]) if plan.emitted_rows else None

        def next_tokens_of() -> torch.Tensor:
            if emitted is not None:
                _write_emitted(next_tokens, tokens, *emitted)
            return next_tokens

        rows_ctx = _rows_context(ctx)
        chain = ChainRows(positions, caps, sent["coverage"], tables, sent.get("state_slots"), block_size,
                          ctx.backends, exact_host_lists)
        rows = CommittedRows(hidden=hidden, next_tokens_of=next_tokens_of, ctx=rows_ctx,
                             last_rows=sent["last_rows"] + accepted, chain=chain)
    history_of = None
    if token_cache is not None:
        bound = max((p + 2 * k + 1 for p in plan.positions), default=1)  # past any shift and accepted count

        def history_of() -> torch.Tensor:
            return token_cache.history(tables, positions, last_tokens, bound)

    inputs = DraftInputs(
        last_tokens=last_tokens, positions=positions, seeds=sent["seeds"],
        temperature=sent["temperature"], k=k, rows=rows, sampling=plan.sampling,
        history_of=history_of)
    return inputs, chain, caps


def _write_emitted(next_tokens: torch.Tensor, tokens: StepTokens, rows: torch.Tensor, at: torch.Tensor) -> None:
    """The tokens the step emitted (flat indices ``at`` of its ``[S, K+1]`` tokens) into ``next_tokens`` at the
    step's ``rows`` that produced them."""
    next_tokens.index_copy_(0, rows, tokens.emitted.reshape(-1).index_select(0, at).clamp(min=0))


def _rows_context(ctx: ForwardContext) -> ForwardContext:
    """The step's context as the drafter's layers see its rows: as the model's layers saw them, without
    bounded-replay floors."""
    return dataclasses.replace(ctx, visibility_floor=None, visibility_floor_host=None, truncation_floor_host=None,
                               truncation_compact_host=None)


def _rows_only_inputs(plan: DraftPlan, tokens: StepTokens, *, k: int, input_ids: torch.Tensor, ctx: ForwardContext,
                      hidden: torch.Tensor | None, block_size: int, exact_host_lists: Callable[[ForwardContext], None]
                      ) -> tuple[DraftInputs, ChainRows | None, torch.Tensor]:
    """``draft_inputs`` of a drafting for no request (every one paused, or none may use a draft): empty
    per-request fields and, for a drafter that reads them, the step's rows; their next tokens, if it reads them,
    from three of ``draft_fields``' lists instead of a dozen (a paused request's every step pays this, issue 28)."""
    dev = input_ids.device
    none = torch.empty(0, dtype=torch.int64, device=dev)
    rows = chain = None
    if hidden is not None:
        def next_tokens_of() -> torch.Tensor:
            fields = draft_fields(plan, rows=input_ids.shape[0], emitted_width=tokens.emitted.shape[1],
                                  with_rows=True)
            next_tokens, emitted_rows, emitted_at = to_device_many(
                [fields[name] for name in ("next_tokens", "emitted_rows", "emitted_at")], dev)
            if plan.emitted_rows:
                _write_emitted(next_tokens, tokens, emitted_rows, emitted_at)
            return next_tokens

        chain = ChainRows(none, none, none, none.reshape(0, 1), None, block_size, ctx.backends, exact_host_lists)
        rows = CommittedRows(hidden=hidden, next_tokens_of=next_tokens_of, ctx=_rows_context(ctx), last_rows=none,
                             chain=chain)
    inputs = DraftInputs(last_tokens=none, positions=none, seeds=none, temperature=none.float(), k=k, rows=rows,
                         sampling=False, history_of=None)
    return inputs, chain, none
