"""Logits processing on the device: repetition, frequency and presence penalties, ``logit_bias``,
``allowed_token_ids`` and the early-EOS ban (``first_n_token_no_eos``), without a host sync.

Each request that asks for any of them (``SamplingParams.processes_logits``) owns a *slot* in tables
kept on the device:

- ``counts [S, V]`` int32: how often each token occurs in the request's output so far;
- ``seen [S, V]`` bool: the tokens of its prompt (the repetition penalty looks at prompt and output);
- ``bias [S, V]`` float32: its ``logit_bias`` plus −inf outside ``allowed_token_ids`` (allocated only
  once some request uses either).

The host part (``plan``, called while a step is prepared) assigns slots and lists what the device
must do; it never reads a device tensor. The device part runs in the step's ``execute``: ``apply``
first rebuilds the slots of requests that are new or were preempted since (from the tokens the host
knows: preemption drops tokens still on the device) and grows the tables, then adjusts the step's
logits rows; ``record`` adds the tokens the step emitted to the counts, from the sampled or verified
tokens themselves, so the next step sees them even when the host has not read them yet (the
overlapped executor). Every device write happens inside ``execute``, and steps execute in the order
they were prepared, so a slot given to a new request is rebuilt after every write of a step in
flight for its previous owner.

Under speculative verification, row ``j`` of a request (the distribution of the token after ``j``
drafts) sees the counts plus drafts ``1..j``: the penalized target distribution is exactly what the
sampler would draw from at that position had the drafts been sampled, so verification stays lossless.

The order of operations follows vLLM's: bias and allowed tokens, then the repetition penalty, then
frequency and presence, then the EOS ban. Every operation is per row, so a row's result never depends
on the rest of the batch (batch invariance). Logprobs stay those of the raw logits (API.md §4).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.model.transfer import to_device
from deepinfer.sampling.params import SamplingParams


@dataclass(frozen=True)
class PenaltyRow:
    """One sampling request of a step, as the penalty state reads it (plain data, no engine objects).

    ``prompt_token_ids`` and ``output_token_ids`` (the output tokens known on the host) are read only
    when the request's slot is rebuilt. ``first_row`` is its first row among the step's sampled logits
    rows; it owns ``1 + len(drafts)`` of them. ``output_index`` is the output index of the token its first row produces.
    ``banned_eos`` are the tokens ``first_n_token_no_eos`` bans.
    """

    request_id: str
    epoch: int
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    first_row: int
    output_index: int
    drafts: Sequence[int]
    banned_eos: frozenset[int]


@dataclass(frozen=True)
class PenaltyStep:
    """What the device does for one step (built by ``PenaltyState.plan``; tensors on the device).

    Rebuilds: ``reset_slots`` are cleared, then ``reset_count_slot``/``reset_count_token`` counted and
    ``reset_seen_slot``/``reset_seen_token`` marked; ``bias_slots`` get the base ``bias_base`` (0, or
    −inf when the request lists allowed tokens), ``allowed_slot``/``allowed_token`` are set back to 0,
    then ``bias_entry_slot``/``bias_entry_token``/``bias_entry_value`` are added. ``capacity`` is the
    slot count the tables need; ``uses_bias`` whether the bias table must exist.

    Adjustment: ``rows [P]`` (indices of the step's sampled logits rows) of slots ``row_slot [P]`` with
    per-row ``presence``/``frequency``/``repetition`` penalties; ``draft_tokens``/``draft_weights
    [P, K]`` add each row's preceding drafts to its counts; ``bias_rows`` index the ``rows`` whose slot
    has a bias row; ``ban_rows``/``ban_tokens`` get −inf.

    Recording: ``record_requests [M]`` index the step's sampling requests (the rows of the sampled or
    verified tokens) whose tokens go to slots ``record_slots [M]``.
    """

    capacity: int
    uses_bias: bool
    reset_slots: torch.Tensor
    reset_count_slot: torch.Tensor
    reset_count_token: torch.Tensor
    reset_seen_slot: torch.Tensor
    reset_seen_token: torch.Tensor
    bias_slots: torch.Tensor
    bias_base: torch.Tensor
    allowed_slot: torch.Tensor
    allowed_token: torch.Tensor
    bias_entry_slot: torch.Tensor
    bias_entry_token: torch.Tensor
    bias_entry_value: torch.Tensor
    rows: torch.Tensor
    row_slot: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    draft_tokens: torch.Tensor
    draft_weights: torch.Tensor
    bias_rows: torch.Tensor
    ban_rows: torch.Tensor
    ban_tokens: torch.Tensor
    record_requests: torch.Tensor
    record_slots: torch.Tensor


class PenaltyState:
    """Per-request device tables and their slots (see the module docstring). One per runner."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._slots: dict[str, tuple[int, int]] = {}  # request id -> (slot, epoch when last rebuilt)
        self._has_bias: set[int] = set()  # slots whose current owner has a bias row
        self._free: list[int] = []  # a heap, so slot numbers stay small
        self._next = 0
        # Device tables, touched only by ``apply``/``record`` (the device side).
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        """Slots held by live requests."""
        return len(self._slots)

    def release(self, request_id: str) -> None:
        """The request finished: its slot may be given to another (which rebuilds it before use)."""
        entry = self._slots.pop(request_id, None)
        if entry is not None:
            self._has_bias.discard(entry[0])
            heapq.heappush(self._free, entry[0])

    def _slot(self, row: PenaltyRow) -> tuple[int, bool]:
        """The row's slot and whether it must be rebuilt (new request, or preempted since)."""
        entry = self._slots.get(row.request_id)
        if entry is not None and entry[1] == row.epoch:
            return entry[0], False
        if entry is None:
            slot = heapq.heappop(self._free) if self._free else self._next
            self._next = max(self._next, slot + 1)
        else:
            slot = entry[0]
        self._slots[row.request_id] = (slot, row.epoch)
        return slot, True

    def plan(self, rows: Sequence[PenaltyRow], max_drafts: int) -> PenaltyStep | None:
        """Host side: the device work of a step whose sampling requests are ``rows`` (in sampler order;
        only those whose params process logits are read), with drafts padded to ``max_drafts``.
        None when no row processes logits."""
        resets: list[int] = []
        count_slot: list[int] = []
        count_token: list[int] = []
        seen_slot: list[int] = []
        seen_token: list[int] = []
        bias_slots: list[int] = []
        bias_base: list[float] = []
        allowed_slot: list[int] = []
        allowed_token: list[int] = []
        entry_slot: list[int] = []
        entry_token: list[int] = []
        entry_value: list[float] = []
        out_rows: list[int] = []
        row_slot: list[int] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        draft_tokens: list[list[int]] = []
        draft_weights: list[list[int]] = []
        bias_rows: list[int] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        record_requests: list[int] = []
        record_slots: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if not p.processes_logits:
                continue
            slot, rebuild = self._slot(row)
            if rebuild:
                resets.append(slot)
                outputs = list(row.output_token_ids)
                count_slot.extend([slot] * len(outputs))
                count_token.extend(outputs)
                if p.repetition_penalty != 1:
                    prompt = sorted(set(row.prompt_token_ids))
                    seen_slot.extend([slot] * len(prompt))
                    seen_token.extend(prompt)
                self._has_bias.discard(slot)
                if p.logit_bias or p.allowed_token_ids is not None:
                    self._has_bias.add(slot)
                    bias_slots.append(slot)
                    bias_base.append(0.0 if p.allowed_token_ids is None else float("-inf"))
                    allowed = sorted(set(p.allowed_token_ids or ()))
                    allowed_slot.extend([slot] * len(allowed))
                    allowed_token.extend(allowed)
                    for token, value in sorted((p.logit_bias or {}).items()):
                        entry_slot.append(slot)
                        entry_token.append(token)
                        entry_value.append(value)
            record_requests.append(i)
            record_slots.append(slot)
            drafts = list(row.drafts)
            padded = drafts + [0] * (max_drafts - len(drafts))
            for j in range(1 + len(drafts)):
                local = len(out_rows)
                out_rows.append(row.first_row + j)
                row_slot.append(slot)
                presence.append(p.presence_penalty)
                frequency.append(p.frequency_penalty)
                repetition.append(p.repetition_penalty)
                draft_tokens.append(padded)
                draft_weights.append([1 if m < j else 0 for m in range(max_drafts)])
                if slot in self._has_bias:
                    bias_rows.append(local)
                if row.output_index + j < p.first_n_token_no_eos:
                    for token in sorted(row.banned_eos):
                        ban_rows.append(row.first_row + j)
                        ban_tokens.append(token)
        if not out_rows:
            return None
        dev = self.device

        def ints(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return to_device(values, dtype, dev)

        def floats(values: list) -> torch.Tensor:
            return to_device(values, torch.float32, dev)

        k = max_drafts
        return PenaltyStep(
            capacity=self._next,
            uses_bias=bool(self._has_bias),
            reset_slots=ints(resets),
            reset_count_slot=ints(count_slot),
            reset_count_token=ints(count_token),
            reset_seen_slot=ints(seen_slot),
            reset_seen_token=ints(seen_token),
            bias_slots=ints(bias_slots),
            bias_base=floats(bias_base),
            allowed_slot=ints(allowed_slot),
            allowed_token=ints(allowed_token),
            bias_entry_slot=ints(entry_slot),
            bias_entry_token=ints(entry_token),
            bias_entry_value=floats(entry_value),
            rows=ints(out_rows),
            row_slot=ints(row_slot),
            presence=floats(presence),
            frequency=floats(frequency),
            repetition=floats(repetition),
            draft_tokens=ints(draft_tokens).reshape(len(out_rows), k),
            draft_weights=ints(draft_weights, torch.int32).reshape(len(out_rows), k),
            bias_rows=ints(bias_rows),
            ban_rows=ints(ban_rows),
            ban_tokens=ints(ban_tokens),
            record_requests=ints(record_requests),
            record_slots=ints(record_slots),
        )

    # ----------------------------------------------------------------------------- device side

    def _grow(self, step: PenaltyStep) -> None:
        """Tables with at least ``step.capacity`` slots (doubling), keeping the existing rows."""
        v, dev = self.vocab_size, self.device
        have = 0 if self.counts is None else self.counts.shape[0]
        if have < step.capacity:
            size = max(step.capacity, 2 * have, 8)
            counts = torch.zeros(size, v, dtype=torch.int32, device=dev)
            seen = torch.zeros(size, v, dtype=torch.bool, device=dev)
            if self.counts is not None and self.seen is not None:
                counts[:have] = self.counts
                seen[:have] = self.seen
            self.counts, self.seen = counts, seen
        assert self.counts is not None
        size = self.counts.shape[0]
        if step.uses_bias and (self.bias is None or self.bias.shape[0] < size):
            bias = torch.zeros(size, v, dtype=torch.float32, device=dev)
            if self.bias is not None:
                bias[:self.bias.shape[0]] = self.bias
            self.bias = bias

    def _rebuild(self, step: PenaltyStep) -> None:
        """Rebuild the slots of new or re-admitted requests from their known tokens and their params."""
        assert self.counts is not None and self.seen is not None
        if step.reset_slots.numel():
            self.counts.index_fill_(0, step.reset_slots, 0)
            self.seen.index_fill_(0, step.reset_slots, False)
            ones = torch.ones_like(step.reset_count_token, dtype=torch.int32)
            self.counts.index_put_((step.reset_count_slot, step.reset_count_token), ones, accumulate=True)
            self.seen.index_put_((step.reset_seen_slot, step.reset_seen_token),
                                 torch.ones_like(step.reset_seen_token, dtype=torch.bool))
        if step.bias_slots.numel():
            assert self.bias is not None
            # Base 0 (or −inf with allowed tokens), the allowed tokens back to 0, then the biases added:
            # a biased token outside the allowed ones stays −inf.
            self.bias[step.bias_slots] = step.bias_base.unsqueeze(1).expand(-1, self.vocab_size)
            self.bias.index_put_((step.allowed_slot, step.allowed_token),
                                 torch.zeros_like(step.allowed_token, dtype=torch.float32))
            self.bias.index_put_((step.bias_entry_slot, step.bias_entry_token), step.bias_entry_value,
                                 accumulate=True)

    def apply(self, step: PenaltyStep, logits: torch.Tensor) -> torch.Tensor:
        """Device side: bring the tables up to date, then the adjusted copy of the step's sampled logits
        rows ``logits [T, V]`` (float32). The input is left as it is (logprobs read it)."""
        self._grow(step)
        self._rebuild(step)
        assert self.counts is not None and self.seen is not None
        x = logits.index_select(0, step.rows)
        if step.bias_rows.numel():
            assert self.bias is not None
            slots = step.row_slot.index_select(0, step.bias_rows)
            x.index_add_(0, step.bias_rows, self.bias.index_select(0, slots))
        counts = self.counts.index_select(0, step.row_slot)
        if step.draft_tokens.shape[1]:
            counts.scatter_add_(1, step.draft_tokens, step.draft_weights)
        occurred = counts > 0
        seen = occurred | self.seen.index_select(0, step.row_slot)
        rp = step.repetition.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        x = x - step.frequency.unsqueeze(1) * counts - step.presence.unsqueeze(1) * occurred
        out = logits.index_copy(0, step.rows, x)
        if step.ban_rows.numel():
            out.index_put_((step.ban_rows, step.ban_tokens),
                           torch.full(step.ban_tokens.shape, float("-inf"), dtype=out.dtype, device=out.device))
        return out

    def record(self, step: PenaltyStep, tokens: torch.Tensor) -> None:
        """Device side: add the step's emitted tokens to the counts. ``tokens`` is ``[N]`` (sampled, one
        per sampling request) or ``[N, K + 1]`` (verified: accepted drafts and the final token, −1
        after)."""
        assert self.counts is not None
        picked = tokens.index_select(0, step.record_requests)
        if picked.dim() == 1:
            picked = picked.unsqueeze(1)
        slots = step.record_slots.unsqueeze(1).expand_as(picked)
        real = picked >= 0
        self.counts.index_put_((slots.reshape(-1), picked.clamp(min=0).reshape(-1)),
                               real.reshape(-1).to(torch.int32), accumulate=True)
