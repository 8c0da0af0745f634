"""The core's speculative decoding mechanism (ARCHITECTURE §5, reference/deepinfer.md §4–§5).

The decisions come from plugins: a ``Drafter`` proposes draft tokens after every step that committed
tokens, and a ``VerificationPlan`` grants each decode request a number of drafts to verify. This
module holds the glue: it caps drafts at what a request may still emit, asks the plan (budget, then
split), hands the drafter its inputs and keeps each request's proposal (``Drafts``, by request id and
epoch: the proposal lives here, not on the request, and reaches the step rows through the plan), and
feeds each decode step's measured times (forward, sampler, drafting) to the step-cost model.
Verification itself is ``sampling/verify.py``; the rollback of rejected positions is the core's
``process`` (a request's computed length goes back to its last accepted token, so the next step
overwrites their KV). When the plan verifies none of the drafts a request offered, that request's
drafting pauses for up to 1, 2, 4 … (at most ``PAUSE_LIMIT``) steps while that repeats, resuming on
rounds shared with the other paused requests (``Speculator._note_grants``): the engine then decodes
it without paying for drafts that would not be verified, and probes again after the pause, while
requests whose drafts the plan takes keep drafting. A new request starts at the pause its predecessors
reached in the newest round that offered drafts (0 once the plan granted any): at a batch where drafts
do not pay, each request would otherwise learn it anew through 1, 2, 4 … rounds of probes, and each
probe pays a drafting step (with ``dspark`` on the H200, 7–15 ms against a 3.4 ms decode step).
A probe verifies its first draft even when the plan grants none (``EXPLORE_DRAFTS``): the plan judges
drafts by calibrated confidences and measured step costs, which only verification teaches, so a plan
that turned pessimistic on a few early rejections would otherwise never see a draft again. Under an
overlapped executor a follow-up row whose request has no proposal on the host (its first drafting, or
the first after a pause, is still on the device) offers no confidence: it verifies as a probe does and its
grant does not move the pause (judged on nothing, a resuming request paused again at once, so ``varlen``
hardly drafted under overlap: CPU batch 1 1.02× of no speculation against 1.39× with this rule).
Probes and resumed drafting cost a drafting step and verified rows whatever they find, so at a batch size where
the plan says drafting cannot pay for a typical request (``VerificationPlan.drafting_pays``, optional: weighed
with the drafts offered so far) no request drafts after the step, probes included; the drafter still
takes the step's rows (its cache stays whole for when the batch shrinks). On the 2-core Xeon at batch 32 the
probes and resumptions had cost ~8% of a run that drafted nothing (``docs/benchmarks.md``).

Drafting runs on the device, in the step itself, right after its sampling or verification
(``draft``; ``engine/drafting.py``): the host plans it when it prepares the step (``plan_drafting``:
which sampling rows draft, and their rows and positions if the step accepts none of their drafts), the
device adds each request's accepted count, and the proposal comes back to the host with the step's
tokens (``keep``). So under an overlapped executor the drafts exist on the device before the next
forward. Drafters with a paged cache of their own on the main pool's block ids (MTP) also get the
step's rows (``CommittedRows``): the main model's final hidden state of every row the step computed,
the token after each, and the step's ``ForwardContext``, so the drafter writes its cache row for every
main-model token (prefill chunks included; a rejected draft's row lands past the committed length and
is written again once that position is computed for real). Its chained drafts write rows past the
committed length, on blocks the scheduler reserved without preempting anyone (``Scheduler``'s draft
reserve): a request whose table could not grow gets fewer drafts. A drafter that reads chosen layers'
features (``dspark``, through the model's ``capture_hidden``) gets the same rows with those features
in place of the final hidden state.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.drafting import DraftPlan, StepTokens, TokenCache, draft_inputs
from deepinfer.engine.request import Request
from deepinfer.interfaces import Drafter, ForwardContext, StepCostModel, VerificationPlan
from deepinfer.model.transfer import pinned_copy
from deepinfer.rows import StepRow

MIN_CONFIDENCE = 1e-6  # a real draft never has confidence 0, which marks "no draft" for plans
PAUSE_LIMIT = 64  # the longest drafting pause, in steps (Speculator._note_grants)
EXPLORE_DRAFTS = 1  # drafts a probe verifies when its plan grants fewer (Speculator.plan_drafts)
PAYS_REFRESH = 32  # proposal rounds between two asks of the plan's drafting_pays for one batch size

if TYPE_CHECKING:
    from deepinfer.engine.scheduler import SchedulerOutput


def room(req: Request) -> int:
    """Drafts that can still matter for ``req``: it emits at most 1 + drafts tokens, within
    ``max_tokens`` and the model length (may be ≤ 0)."""
    return min(req.params.max_tokens - req.num_output_tokens, req.max_total_tokens - req.num_tokens) - 1


@dataclass(frozen=True)
class Drafts:
    """A request's proposal after its last committed token (speculative decoding): draft ``tokens``,
    the ``confidence`` the plan ranks them by (calibrated), the drafter's ``raw_confidence``, and
    ``probs``, the drafter's distributions ``[k, V]`` on the device (None: one-hot). ``epoch``: the
    request's epoch when proposed; a preempted or finished request's proposal is stale. ``on_device``:
    a stand-in for a proposal drafted on the device and not read yet (a follow-up row's): only the
    number of ``tokens`` (placeholders) counts."""

    epoch: int
    tokens: tuple[int, ...] = ()
    confidence: tuple[float, ...] = ()
    raw_confidence: tuple[float, ...] = ()
    probs: torch.Tensor | None = None
    on_device: bool = False

    def granted(self, n: int) -> Drafts:
        """The first ``n`` drafts (the plan's grant); ``probs`` stay whole (rows read their first ``n``)."""
        return replace(self, tokens=self.tokens[:n], confidence=self.confidence[:n],
                       raw_confidence=self.raw_confidence[:n])


@dataclass
class DeviceProposal:
    """The drafting after a step, on the device (``Speculator.draft``): per drafting request of the step's
    ``DraftPlan`` the draft ``tokens [B, k]`` (−1 past its drafts: past what it may use, or where the
    drafter had none), their calibrated ``confidence`` and ``raw_confidence`` ``[B, k]`` (0 past them), and
    ``probs [B, k, V]`` (None: one-hot drafts). ``host``: ``[3, B, k]`` float64 (tokens, confidence, raw)
    readable on the host once the step's results are (a pinned copy on CUDA)."""

    plan: DraftPlan
    tokens: torch.Tensor
    confidence: torch.Tensor
    raw_confidence: torch.Tensor
    probs: torch.Tensor | None
    host: torch.Tensor | None = None

    def stacked(self) -> torch.Tensor:
        return torch.stack([self.tokens.double(), self.confidence.double(), self.raw_confidence.double()])

    def copy_to_host(self) -> None:
        """Start the copy of the proposal to pinned host memory (CUDA: valid once the step's event fired); an
        empty proposal has its host copy already."""
        if self.host is None:
            self.host = pinned_copy(self.stacked())


def _room_after(req: Request, token_slot: int) -> int:
    """``room`` of ``req`` once the step that samples its token ``token_slot`` committed it and no draft."""
    length = token_slot + 1
    return min(req.params.max_tokens - (length - req.num_prompt_tokens), req.max_total_tokens - length) - 1


def _last_known_row(first_row: int, row: StepRow) -> int:
    """The step's token row of the request's last known token (its drafts follow it)."""
    return first_row + row.num_new_tokens - 1 - row.draft_rows


class _PlanBuilder:
    """Collects a ``DraftPlan`` row by row, in the step's order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.samplers: list[int] = []
        self.request_ids: list[str] = []
        self.last_rows: list[int] = []
        self.positions: list[int] = []
        self.rooms: list[int] = []
        self.coverage: list[int] = []
        self.tables: list[list[int]] = []
        self.seeds: list[int] = []
        self.temperatures: list[float] = []
        self.state_slots: list[int] = []
        self.next_tokens: list[int] = []
        self.emitted_rows: list[int] = []
        self.emitted_from: list[tuple[int, int]] = []

    def chunk(self, row: StepRow, next_token: int) -> None:
        """A row that samples nothing (a prefill chunk): every next token is an input token of the step or,
        after its last row, ``next_token``."""
        self.next_tokens.extend(max(t, 0) for t in row.token_ids[1:])
        self.next_tokens.append(next_token)

    def emitting(self, first_row: int, row: StepRow, sampler: int) -> None:
        """A row that samples: the step emits the next token of its last token's row and of each draft's."""
        self.next_tokens.extend(max(t, 0) for t in row.token_ids[1:])
        self.next_tokens.append(0)
        base = _last_known_row(first_row, row)
        for j in range(row.draft_rows + 1):
            self.emitted_rows.append(base + j)
            self.emitted_from.append((sampler, j))

    def drafting(self, sampler: int, row: StepRow, first_row: int, room: int) -> None:
        """The sampling row ``sampler`` (starting at the step's token row ``first_row``) drafts after the step,
        ``room`` drafts left to it (``DraftPlan``'s per-request fields)."""
        self.samplers.append(sampler)
        self.request_ids.append(row.request_id)
        self.last_rows.append(_last_known_row(first_row, row))
        self.positions.append(row.end - row.draft_rows)
        self.rooms.append(room)
        self.coverage.append(len(row.block_table) * self.block_size)
        self.tables.append(list(row.block_table))
        self.seeds.append(row.seed)
        self.temperatures.append(0.0 if row.params.greedy else row.params.temperature)
        if row.state_slot is not None:
            self.state_slots.append(row.state_slot)

    def build(self) -> DraftPlan:
        return DraftPlan(self.samplers, self.request_ids, self.last_rows, self.positions, self.rooms, self.coverage,
                         self.tables, self.seeds, self.temperatures, self.state_slots or None,
                         self.next_tokens, self.emitted_rows, self.emitted_from)


class Speculator:
    """Drafts, verification plans and the step-cost model of one engine."""

    def __init__(self, drafter: Drafter, plan: VerificationPlan, cost: StepCostModel, max_draft: int, *,
                 block_size: int, reads_rows: bool = False,
                 token_cache: TokenCache | None = None,
                 exact_host_lists: Callable[[ForwardContext], None] = lambda ctx: None) -> None:
        self.drafter = drafter
        self.plan = plan
        self.cost = cost
        self.max_draft = max_draft
        self.block_size = block_size
        self.reads_rows = reads_rows  # the drafter reads the step's rows (MTP, dspark): DraftInputs.rows
        self.token_cache = token_cache  # tokens per KV slot, for DraftInputs.history
        # Makes a context's host lists match its device tensors when the backends read them (ModelRunner).
        self.exact_host_lists = exact_host_lists
        self.proposals: dict[str, Drafts] = {}  # request id -> its newest proposal
        self._pause: dict[str, int] = {}  # request id -> its drafting pause length (steps), PAUSE_LIMIT at most
        self._resume_at: dict[str, int] = {}  # request id -> the proposal round its paused drafting resumes at
        self._round = 0  # proposal rounds so far (one per drafting step)
        self._learned_pause = 0  # the pause a new request starts at (_note_grants)
        self._drafted: set[str] = set()  # the requests the newest planned drafting drafts for
        self._pays: dict[int, tuple[bool, int]] = {}  # batch size -> (plan.drafting_pays, the round it was asked)

    def drafts_of(self, req: Request) -> Drafts | None:
        """``req``'s live proposal (None when it has none, or only one from before it was preempted)."""
        drafts = self.proposals.get(req.request_id)
        return drafts if drafts is not None and drafts.epoch == req.epoch else None

    def forget(self, request_id: str) -> None:
        """Drop a finished request's proposal and drafting pause."""
        self.proposals.pop(request_id, None)
        self._pause.pop(request_id, None)
        self._resume_at.pop(request_id, None)

    def paused(self, request_id: str) -> bool:
        """Whether the request's next proposal is skipped (its drafting pause has steps left). The
        scheduler lets such a request run while its previous step is in flight: the proposal made
        after that step skips it, so there is no draft to wait for (``Scheduler._awaits_drafts``)."""
        return self._resume_at.get(request_id, 0) > self._round

    @staticmethod
    def draft_limit(req: Request, drafts: Drafts) -> int:
        """Drafts ``req`` may verify of its proposal ``drafts``: it emits at most 1 + drafts tokens,
        within ``max_tokens`` and the model length."""
        return max(0, min(len(drafts.tokens), room(req)))

    def plan_drafts(self, requests: Sequence[Request], following: Collection[str] = ()) -> dict[str, Drafts]:
        """The drafts each decode request verifies this step (the scheduler's ``DraftPlanner``): the
        plan's grant over the requests with a proposal, in the order given. Every decode request of the
        step is a row of the plan's confidences, those without a proposal all zeros: they verify
        nothing, but their rows are in the step and in its time, which the plan weighs drafts against.
        ``following``: requests whose previous step is in flight (follow-up rows): their proposal is the
        one drafted on the device after that step, unknown here, so the plan weighs ``max_draft`` drafts
        by the confidences of the drafts that step verifies (the stale ones the plan's ``budget``
        expects), ``MIN_CONFIDENCE`` past them, and grants a number of drafts (``Drafts.on_device``)."""
        offers = [(i, r, self._offer(r, following)) for i, r in enumerate(requests)]
        proposed = [(i, r, d) for i, r, d in offers if d is not None and d.tokens]
        if not proposed:
            return {}
        rows = [[0.0] * self.max_draft for _ in requests]
        limits = [0] * len(requests)
        for i, req, drafts in proposed:
            n = limits[i] = min(self.draft_limit(req, drafts), self.max_draft)
            rows[i][:n] = drafts.confidence[:n]
        confidence = torch.tensor(rows, dtype=torch.float32)
        # Synchronous steps see the newest confidences on the host, so budget and split use the same.
        total = self.plan.budget(confidence, self.cost)
        split = self.plan.split(confidence, total).tolist()
        granted = {i: min(int(split[i]), limits[i]) for i, _, _ in proposed}
        # A follow-up row whose request has no proposal on the host (its first drafting, or the first after a
        # pause, is still on the device) offers no confidence: the plan's grant says nothing about its drafts,
        # so it does not move the pause, and the row verifies as a probe does.
        unknown = {i for i, req, drafts in proposed if drafts.on_device and self.drafts_of(req) is None}
        probes = [i for i, req, _ in proposed if self._pause.get(req.request_id, 0) or i in unknown]
        self._note_grants([(req.request_id, limits[i], granted[i]) for i, req, _ in proposed if i not in unknown])
        for i in probes:  # the pause follows the plan's grant; the probe still verifies (module docstring)
            granted[i] = max(granted[i], min(EXPLORE_DRAFTS, limits[i]))
        return {req.request_id: drafts.granted(granted[i]) for i, req, drafts in proposed}

    def _offer(self, req: Request, following: Collection[str]) -> Drafts | None:
        """The proposal ``req`` offers the plan: its live one, or for a follow-up row (``following``) a
        stand-in for the one drafted on the device after its step in flight (None: it did not draft)."""
        if req.request_id not in following:
            return self.drafts_of(req)
        if req.request_id not in self._drafted:
            return None
        # Positions the verified proposal did not reach rank last (a plan that weighs them verifies them
        # last), yet count: ``fixed`` grants every one, as it does the synchronous executor's proposal.
        stale = self.drafts_of(req)
        known = stale.confidence[:self.max_draft] if stale is not None else ()
        confidence = (*known, *(MIN_CONFIDENCE,) * (self.max_draft - len(known)))
        return Drafts(req.epoch, (-1,) * len(confidence), confidence, confidence, on_device=True)

    def _note_grants(self, grants: Sequence[tuple[str, int, int]]) -> None:
        """The drafting pause, per request, from ``(request id, drafts offered, drafts granted)``: after a
        step whose plan verified none of the drafts a request offered (they did not pay: ``varlen`` at a
        batch where the verified rows cost more than they bring), that request's pause length doubles
        (1, 2, 4 … up to ``PAUSE_LIMIT``) while that repeats, and its drafting resumes at the next
        proposal round that is a multiple of that length, so the engine decodes it without paying for its
        drafting; a step that verifies one of its drafts ends its pause. Paused requests resume on shared
        rounds: a drafting step costs much whatever its size (the drafter's forward), and requests that
        probed on rounds of their own would have it run nearly every step. Requests the plan keeps
        granting draft on: at a large batch only they pay for drafting. The round's smallest new pause is
        where new requests start (``_start_paused``)."""
        pauses = []
        for request_id, offered, granted in grants:
            if not offered:
                continue
            pause = min(max(1, 2 * self._pause.get(request_id, 0)), PAUSE_LIMIT) if granted == 0 else 0
            pauses.append(pause)
            self._pause_until(request_id, pause)
            if pause:  # a paused request holds no proposal: planned again later (under overlap, while this
                self.proposals.pop(request_id, None)  # step is in flight) it would verify stale drafts
        if pauses:
            self._learned_pause = min(pauses)

    def _pause_until(self, request_id: str, pause: int) -> None:
        """Pause ``request_id``'s drafting for ``pause`` rounds (0: none), resuming on a round that is a
        multiple of it."""
        self._pause[request_id] = pause
        self._resume_at[request_id] = (self._round // pause + 1) * pause if pause else 0

    def _start_paused(self, request_id: str) -> None:
        """A request not seen before starts at the learned pause (module docstring)."""
        if request_id not in self._pause and self._learned_pause:
            self._pause_until(request_id, self._learned_pause)

    def _drafting_pays(self, batch: int) -> bool:
        """The plan's ``drafting_pays`` at a step of ``batch`` sampling rows (True for a plan without it), asked
        again every ``PAYS_REFRESH`` proposal rounds per batch size (it weighs the step-cost model and the
        drafts offered so far, both of which move slowly). False, for a gating plan, while the step-cost model
        wants plain steps to learn the baseline's host time (``wants_plain_steps``)."""
        ask = getattr(self.plan, "drafting_pays", None)
        if ask is None:
            return True
        wants_plain = getattr(self.cost, "wants_plain_steps", None)
        if wants_plain is not None and wants_plain():
            return False  # a plain round: the cost model learns the baseline's host time (engine/cost.py)
        known = self._pays.get(batch)
        if known is None or self._round - known[1] >= PAYS_REFRESH:
            known = self._pays[batch] = (bool(ask(batch, self.cost)), self._round)
        return known[0]

    def plan_drafting(self, batch: SchedulerOutput, samplers: Sequence[StepRow]) -> DraftPlan | None:
        """What the host knows of the drafting after the step ``batch`` when it prepares it (``DraftPlan``):
        every sampling row drafts, but a request whose drafting is paused or that may emit no more than
        one token; the drafter runs even with no request to draft for when it reads the step's rows (its
        cache rows must be written). None: no drafting after this step. One proposal round."""
        sampler_of = {row.request_id: i for i, row in enumerate(samplers)}
        dormant = not self._drafting_pays(len(samplers))
        plan = _PlanBuilder(self.block_size)
        first_row = 0
        for s, row in zip(batch.scheduled, batch.rows, strict=True):
            req = s.request
            if s.samples:
                i = sampler_of[row.request_id]
                plan.emitting(first_row, row, i)
                self._start_paused(req.request_id)
                room_after = _room_after(req, s.token_slot)
                if dormant or self.paused(req.request_id) or room_after <= 0:  # no proposal until it drafts again
                    self.proposals.pop(req.request_id, None)
                else:
                    plan.drafting(i, row, first_row, room_after)
            else:
                plan.chunk(row, req.all_token_ids[row.end] if row.end < req.num_tokens else 0)
            first_row += row.num_new_tokens
        self._round += 1
        self._drafted = set(plan.request_ids)
        if not plan.samplers and not self.reads_rows:
            return None
        return plan.build()

    def draft(self, plan: DraftPlan, input_ids: torch.Tensor, ctx: ForwardContext, hidden: torch.Tensor | None,
              tokens: StepTokens, sent: dict[str, torch.Tensor] | None = None) -> DeviceProposal:
        """Draft after a step, on the device, from its results (``tokens``) as they are there: nothing here
        reads the device. ``input_ids`` / ``ctx`` / ``hidden`` are the step's (``hidden`` only when the drafter
        reads rows); ``sent``: the plan's fields already on the device (``draft_inputs``). Drafts a request may
        not use are dropped (−1, confidence 0)."""
        inputs, chain, caps = draft_inputs(plan, tokens, k=self.max_draft, input_ids=input_ids, ctx=ctx,
                                           hidden=hidden if self.reads_rows else None, token_cache=self.token_cache,
                                           block_size=self.block_size, exact_host_lists=self.exact_host_lists,
                                           sent=sent)
        proposal = self.drafter.propose(inputs)
        k = self.max_draft
        if not plan.samplers:  # nobody drafts (the drafter took the step's rows): nothing to mask or copy back
            empty = torch.empty(0, k, device=input_ids.device)
            host = torch.empty(3, 0, k, dtype=torch.float64)
            return DeviceProposal(plan, empty.long(), empty, empty, None, host=host)
        if chain is not None:
            caps = chain.draft_caps()
        drafts = proposal.tokens[:, :k]
        cols = torch.arange(k, device=drafts.device)
        usable = torch.cumprod((cols < caps.unsqueeze(1)) & (drafts >= 0), dim=1).bool()  # a prefix of each row
        raw = proposal.raw_confidence if proposal.raw_confidence is not None else proposal.confidence
        # Both confidences in one [2, B, k] tensor: one clamp and one mask for the pair.
        both = torch.stack([proposal.confidence[:, :k], raw[:, :k]]).float().clamp(MIN_CONFIDENCE, 1.0)
        kept = torch.where(usable, both, 0.0)
        probs = proposal.probs[:, :k] if proposal.probs is not None else None
        return DeviceProposal(plan, torch.where(usable, drafts, -1), kept[0], kept[1], probs)

    def record_tokens(self, input_ids: torch.Tensor, ctx: ForwardContext) -> None:
        """Note a step's input tokens at their cache slots (``TokenCache``; every step, drafting or not)."""
        if self.token_cache is not None:
            self.token_cache.write(ctx.slot_mapping, input_ids)

    def keep(self, proposal: DeviceProposal, live: Mapping[str, Request]) -> None:
        """Keep the drafts of a processed step's proposal (``drafts_of``) for its requests still in ``live``
        (request id → request: not stopped by the step, nor finished or preempted since)."""
        host = proposal.host if proposal.host is not None else proposal.stacked()
        tokens = host[0].long().tolist()
        confidence, raw_confidence = host[1].tolist(), host[2].tolist()
        for i, request_id in enumerate(proposal.plan.request_ids):
            req = live.get(request_id)
            if req is None:
                continue
            row = tokens[i]
            n = row.index(-1) if -1 in row else len(row)
            probs = proposal.probs[i, :n] if proposal.probs is not None and n else None
            self.proposals[request_id] = Drafts(req.epoch, tuple(row[:n]), tuple(confidence[i][:n]),
                                                tuple(raw_confidence[i][:n]), probs)

    def observe_step(self, batch: SchedulerOutput, forward_seconds: float, sampler_seconds: float, drafted: int,
                     draft_seconds: float | None, step_seconds: float | None) -> None:
        """Feed a pure decode step's times to the step-cost model: its forward and sampler seconds, the
        seconds of drafting for ``drafted`` requests after it (None: not measured), and its wall time since
        the step before ended (None: none before it)."""
        rows = batch.scheduled
        if rows and all(s.samples and s.num_new_tokens == 1 + s.draft_rows for s in rows):
            self.cost.observe(batch.num_tokens, forward_seconds, sampler_seconds=sampler_seconds, requests=drafted,
                              draft_seconds=draft_seconds, step_seconds=step_seconds)
