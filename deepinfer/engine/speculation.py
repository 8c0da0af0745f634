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
requests whose drafts the plan takes keep drafting.
A probe verifies its first draft even when the plan grants none (``EXPLORE_DRAFTS``): the plan judges
drafts by calibrated confidences and measured step costs, which only verification teaches, so a plan
that turned pessimistic on a few early rejections would otherwise never see a draft again.

Drafters with a paged cache of their own on the main pool's block ids (MTP) also get the step's
committed rows (``CommittedRows``): the main model's final hidden state of every token the step
computed and kept, the token after each, and a ``ForwardContext`` over them, so the drafter writes
its cache row for every main-model token (prefill chunks included). Its chained drafts write rows
past the committed length; the blocks for those positions are allocated here, without preempting
anyone: a request whose table cannot grow gets fewer drafts. A drafter that reads chosen layers'
features (``dspark``, through the model's ``capture_hidden``) gets the same rows with those features
in place of the final hidden state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.request import Request
from deepinfer.interfaces import CommittedRows, Drafter, DraftInputs, ForwardContext, StepCostModel, VerificationPlan

MIN_CONFIDENCE = 1e-6  # a real draft never has confidence 0, which marks "no draft" for plans
PAUSE_LIMIT = 64  # the longest drafting pause, in steps (Speculator._note_grants)
EXPLORE_DRAFTS = 1  # drafts a probe verifies when its plan grants fewer (Speculator.plan_drafts)
SCRATCH_TABLE = (0,)  # block 0 is never handed out (kv/pools.py): rows that must not land anywhere write it
SCRATCH_SLOT = 0  # nor is state slot 0 (kv/state.py): the per-request state of such rows

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
    request's epoch when proposed; a preempted or finished request's proposal is stale."""

    epoch: int
    tokens: tuple[int, ...] = ()
    confidence: tuple[float, ...] = ()
    raw_confidence: tuple[float, ...] = ()
    probs: torch.Tensor | None = None

    def granted(self, n: int) -> Drafts:
        """The first ``n`` drafts (the plan's grant); ``probs`` stay whole (rows read their first ``n``)."""
        return replace(self, tokens=self.tokens[:n], confidence=self.confidence[:n],
                       raw_confidence=self.raw_confidence[:n])


@dataclass(frozen=True)
class DraftCache:
    """What the speculator needs to give a drafter rows on the main paging (``CommittedRows``):
    ``context`` builds a ``ForwardContext`` over spans ``(block table, first position, count)``
    (``ModelRunner.span_context``), ``allocate(request_id, num_tokens)`` grows a request's block table
    without preempting (False: not enough free blocks, nothing changed), ``table`` reads it. For models
    with per-request state (``kv/state.py``, DeepSeek-V4), ``state_slot`` gives a request's state slot
    (None once it gave it back)."""

    context: Callable[[Sequence[tuple[Sequence[int], int, int]]], ForwardContext]
    allocate: Callable[[str, int], bool]
    table: Callable[[str], list[int]]
    block_size: int
    state_slot: Callable[[str], int | None] | None = None

    def rows(self, spans: Sequence[tuple[Sequence[int], int, int]],
             owners: Sequence[str | None]) -> ForwardContext:
        """``context(spans)``; with per-request state also each span's state slot: that of its owner
        (a request id), or the scratch slot for rows nobody reads (no owner, or a finished one)."""
        ctx = self.context(spans)
        if self.state_slot is not None:
            slots = [SCRATCH_SLOT if rid is None else self.state_slot(rid) for rid in owners]
            ctx.state_slots_host = [SCRATCH_SLOT if slot is None else slot for slot in slots]
            ctx.state_slots = torch.tensor(ctx.state_slots_host, dtype=torch.int64, device=ctx.positions.device)
        return ctx


@dataclass(frozen=True)
class CommittedSpan:
    """One request's rows in a processed step: positions ``[start, start + count)`` were computed and
    kept; their hidden rows start at ``first_row`` of the step's hidden states. ``table`` is the
    request's block table when the step was processed (kept because a request that finishes in the
    step gives its blocks back before drafting, and its rows still belong in the cache)."""

    request: Request
    table: Sequence[int]
    start: int
    count: int
    first_row: int


class DraftChain:
    """``CommittedRows.chain``: one decode row per drafting request past its committed tokens.

    Draft j (j ≥ 2) of a request with ``n`` tokens comes from a row at position ``n + j − 3`` (offset
    ``j − 2`` from its last token). ``caps[i]`` is how many drafts request i may keep: what it may
    still emit, lowered on the first call when its table cannot grow to hold the chain's rows."""

    def __init__(self, requests: Sequence[Request], cache: DraftCache, k: int) -> None:
        self.requests = list(requests)
        self.cache = cache
        self.caps = [max(0, min(k, room(r))) for r in self.requests]
        self._allocated = False

    def __call__(self, offset: int) -> ForwardContext:
        if not self._allocated:
            self._allocate()
        spans: list[tuple[Sequence[int], int, int]] = []
        owners: list[str | None] = []
        for req, cap in zip(self.requests, self.caps, strict=True):
            if offset + 2 <= cap:
                spans.append((self.cache.table(req.request_id), req.num_tokens - 1 + offset, 1))
                owners.append(req.request_id)
            else:  # a draft the request drops anyway: run a harmless row on the scratch block (and slot)
                spans.append((SCRATCH_TABLE, 0, 1))
                owners.append(None)
        return self.cache.rows(spans, owners)

    def _allocate(self) -> None:
        """Blocks for every chained row a request may use; called after the committed rows were
        written (the drafter asks for the chain only then), so a block just given back by a request
        that finished this step is written by its new owner's chain alone."""
        self._allocated = True
        for i, req in enumerate(self.requests):
            if self.caps[i] < 2:
                continue
            if not self.cache.allocate(req.request_id, req.num_tokens + self.caps[i] - 2):
                covered = len(self.cache.table(req.request_id)) * self.cache.block_size
                self.caps[i] = max(1, min(self.caps[i], covered - req.num_tokens + 2))


class Speculator:
    """Drafts, verification plans and the step-cost model of one engine."""

    def __init__(self, drafter: Drafter, plan: VerificationPlan, cost: StepCostModel, max_draft: int,
                 device: torch.device, cache: DraftCache | None = None) -> None:
        self.drafter = drafter
        self.plan = plan
        self.cost = cost
        self.max_draft = max_draft
        self.device = device
        self.cache = cache  # set when the drafter reads the committed rows (MTP): DraftInputs.rows
        self.proposals: dict[str, Drafts] = {}  # request id -> its newest proposal
        self._pause: dict[str, int] = {}  # request id -> its drafting pause length (steps), PAUSE_LIMIT at most
        self._resume_at: dict[str, int] = {}  # request id -> the proposal round its paused drafting resumes at
        self._round = 0  # proposal rounds so far (one per propose call)

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

    def plan_drafts(self, requests: Sequence[Request]) -> dict[str, Drafts]:
        """The drafts each decode request verifies this step (the scheduler's ``DraftPlanner``): the
        plan's grant over the requests with a proposal, in the order given. Every decode request of the
        step is a row of the plan's confidences, those without a proposal all zeros: they verify
        nothing, but their rows are in the step and in its time, which the plan weighs drafts against."""
        proposed = [(i, r, d) for i, r in enumerate(requests) if (d := self.drafts_of(r)) is not None and d.tokens]
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
        probes = [i for i, req, _ in proposed if self._pause.get(req.request_id, 0)]  # a pause just ended
        self._note_grants([(req.request_id, limits[i], granted[i]) for i, req, _ in proposed])
        for i in probes:  # the pause follows the plan's grant; the probe still verifies (module docstring)
            granted[i] = max(granted[i], min(EXPLORE_DRAFTS, limits[i]))
        return {req.request_id: drafts.granted(granted[i]) for i, req, drafts in proposed}

    def _note_grants(self, grants: Sequence[tuple[str, int, int]]) -> None:
        """The drafting pause, per request, from ``(request id, drafts offered, drafts granted)``: after a
        step whose plan verified none of the drafts a request offered (they did not pay: ``varlen`` at a
        batch where the verified rows cost more than they bring), that request's pause length doubles
        (1, 2, 4 … up to ``PAUSE_LIMIT``) while that repeats, and its drafting resumes at the next
        proposal round that is a multiple of that length, so the engine decodes it without paying for its
        drafting; a step that verifies one of its drafts ends its pause. Paused requests resume on shared
        rounds: a drafting step costs much whatever its size (the drafter's forward), and requests that
        probed on rounds of their own would have it run nearly every step. Requests the plan keeps
        granting draft on: at a large batch only they pay for drafting."""
        for request_id, offered, granted in grants:
            if not offered:
                continue
            pause = min(max(1, 2 * self._pause.get(request_id, 0)), PAUSE_LIMIT) if granted == 0 else 0
            self._pause[request_id] = pause
            self._resume_at[request_id] = (self._round // pause + 1) * pause if pause else 0
            if pause:  # a paused request holds no proposal: planned again later (under overlap, while this
                self.proposals.pop(request_id, None)  # step is in flight) it would verify stale drafts

    def propose(self, requests: Sequence[Request], spans: Sequence[CommittedSpan] = (),
                hidden: torch.Tensor | None = None) -> tuple[float, int]:
        """Ask the drafter for the next drafts of ``requests`` (each just committed tokens) and keep
        them (``drafts_of``). With a ``cache``, ``spans`` (every live row of the step) and ``hidden``
        (the step's final hidden states) become ``DraftInputs.rows``, and the drafter runs even with
        no request to draft for (its cache rows must still be written). Reads the proposal on the host
        (deliberate: the scheduler needs it), so the seconds returned (0.0: the drafter did not run)
        cover the drafter's device work too. Returns those seconds and the number of requests drafted
        for (paused requests not counted: with every request paused the seconds are the cache rows'
        alone, which the step-cost model must not read as a cost per drafting request)."""
        start = time.perf_counter()
        drafting = []
        for req in requests:  # a paused request does not draft (a drafter's cache rows are still written)
            if self.paused(req.request_id):
                self.proposals.pop(req.request_id, None)
            else:
                drafting.append(req)
        self._round += 1
        requests = drafting
        rows, chain = None, None
        if self.cache is not None and hidden is not None:
            chain = DraftChain(requests, self.cache, self.max_draft)
            rows = self._committed_rows(requests, spans, hidden, chain)
        if not requests and rows is None:
            return 0.0, 0
        dev = self.device
        inputs = DraftInputs(
            last_tokens=torch.tensor([r.all_token_ids[-1] for r in requests], dtype=torch.int64, device=dev),
            token_ids=[r.all_token_ids for r in requests],
            positions=torch.tensor([r.num_tokens - 1 for r in requests], dtype=torch.int64, device=dev),
            seeds=torch.tensor([r.seed for r in requests], dtype=torch.int64, device=dev),
            temperature=torch.tensor([0.0 if r.params.greedy else r.params.temperature for r in requests],
                                     dtype=torch.float32, device=dev),  # below GREEDY_BELOW: greedy (0)
            k=self.max_draft,
            rows=rows,
        )
        proposal = self.drafter.propose(inputs)
        if not requests:
            return time.perf_counter() - start, 0
        raw = proposal.raw_confidence if proposal.raw_confidence is not None else proposal.confidence
        # One device-to-host read for the three (token ids are exact in float64).
        host = torch.stack([proposal.tokens.double(), proposal.confidence.float().clamp(MIN_CONFIDENCE, 1.0).double(),
                            raw.float().double()]).cpu()
        tokens = host[0].long().tolist()
        confidence, raw_confidence = host[1].tolist(), host[2].tolist()
        for i, req in enumerate(requests):
            row = tokens[i][:self.max_draft if chain is None else chain.caps[i]]
            n = row.index(-1) if -1 in row else len(row)
            probs = proposal.probs[i, :n] if proposal.probs is not None and n else None
            self.proposals[req.request_id] = Drafts(req.epoch, tuple(row[:n]), tuple(confidence[i][:n]),
                                                    tuple(raw_confidence[i][:n]), probs)
        return time.perf_counter() - start, len(requests)

    def _committed_rows(self, requests: Sequence[Request], spans: Sequence[CommittedSpan], hidden: torch.Tensor,
                        chain: DraftChain) -> CommittedRows | None:
        """``DraftInputs.rows`` from the step's spans (None when no row has a known next token)."""
        assert self.cache is not None
        kept = []
        for span in spans:
            # Only rows whose next token is known: a stop inside the emitted tokens cut the ones after it.
            count = min(span.count, span.request.num_tokens - 1 - span.start)
            if count > 0:
                kept.append((span, count))
        if not kept:
            return None
        kept.sort(key=lambda item: item[1] != 1)  # one-row spans first: they are the context's decode rows
        index: list[int] = []
        next_tokens: list[int] = []
        last_row: dict[str, int] = {}
        for span, count in kept:
            index.extend(range(span.first_row, span.first_row + count))
            next_tokens.extend(span.request.all_token_ids[span.start + 1:span.start + 1 + count])
            last_row[span.request.request_id] = len(index) - 1
        dev = hidden.device
        return CommittedRows(
            hidden=hidden.index_select(0, torch.tensor(index, dtype=torch.int64, device=dev)),
            next_tokens=torch.tensor(next_tokens, dtype=torch.int64, device=dev),
            ctx=self.cache.rows([(span.table, span.start, count) for span, count in kept],
                                [None if span.request.finished else span.request.request_id for span, _ in kept]),
            last_rows=torch.tensor([last_row[r.request_id] for r in requests], dtype=torch.int64, device=dev),
            chain=chain,
        )

    def observe_step(self, batch: SchedulerOutput, forward_seconds: float, sampler_seconds: float, drafted: int,
                     draft_seconds: float | None) -> None:
        """Feed a pure decode step's times to the step-cost model: its forward and sampler seconds, and
        the seconds of drafting for ``drafted`` requests after it (None: not measured)."""
        rows = batch.scheduled
        if rows and all(s.samples and s.num_new_tokens == 1 + len(s.drafts) for s in rows):
            self.cost.observe(batch.num_tokens, forward_seconds, sampler_seconds=sampler_seconds, requests=drafted,
                              draft_seconds=draft_seconds)
