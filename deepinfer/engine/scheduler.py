"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step the scheduler spends a token budget (``max_num_batched_tokens``): first on running
requests (one decode token each, or the next chunk of a prefill), then on waiting requests in the
order the scheduling policy gives, up to ``max_num_seqs`` running. When KV blocks run out for a
running request, the policy picks a victim; the victim's blocks are freed and it goes back to
waiting, to be recomputed from its tokens (its cached full blocks usually make that a prefix hit).

In-step prefix sharing (``cache.in_step_prefix_sharing``, on by default): a full block becomes a prefix
hit only once the step that computed it has been processed and the block registered, so requests that
share a prefix and are admitted together would each compute it. Admission therefore holds back a
waiting request whose next full block after its prefix hit (by prefix hash) is one that a request in
this step's batch is computing and the cache does not hold yet: a prefill scheduled in this step or
admitted just before it, or, under an overlapped executor, one whose step is still in flight. The held
request stays waiting in its place in the policy's order, and the requests behind it are admitted as
usual; once the blocks are registered it is admitted and hits them (with chunked prefill, a long
shared prefix is waited for chunk by chunk, until no block of it is left in progress). The wait is
bounded by the computing request's progress: it holds others back only while it is in the step's
batch, so a held request never leaves a step empty and is admitted as soon as that request is
preempted, aborted, finished or not scheduled (e.g. sitting a step out for its drafts, or at its
last token under an overlapped executor) — it then computes the blocks itself, as without sharing. In
the synchronous executor a hold lasts one step (a computing request takes the whole budget until its
last chunk, and the blocks are registered when that step is processed); under an overlapped executor
up to two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from deepinfer.engine.request import PENDING, Request, RequestStatus
from deepinfer.engine.speculation import Drafts, room
from deepinfer.interfaces import CacheLayout, ReplayPlan, ReplayPlanner, SchedulePolicy
from deepinfer.kv.blocks import KVCacheManager, PrefixHit
from deepinfer.rows import StepRow


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``num_new_tokens`` tokens from ``start``.

    ``samples``: the chunk reaches the end of the request's tokens, so its logits give a new token,
    which goes to ``all_token_ids[token_slot]``. ``epoch`` is the request's epoch when scheduled.
    ``drafts``: draft tokens verified after the request's last token (speculative decoding); the
    row then computes ``1 + len(drafts)`` tokens and may commit up to that many. ``confidence`` /
    ``raw_confidence``: the drafter's (calibrated / raw) confidences of those drafts, for statistics;
    ``draft_probs``: the distributions of the request's proposal (``Drafts.probs``).

    ``follows``: a follow-up row (``engine/followup.py``): its request's previous step is in flight, so
    the row is laid out as if that step accepted no draft (``start`` and ``token_slot`` move when it is
    processed) and brings ``device_drafts`` draft rows the device fills from the drafts made after that
    step (``drafts`` is then set, for statistics, once the host has read them); ``room`` the drafts the
    request may still use if that step accepted none; ``reach`` the most tokens the row may cover.
    """

    request: Request
    start: int
    num_new_tokens: int
    samples: bool = False
    epoch: int = 0
    token_slot: int = -1
    drafts: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    raw_confidence: list[float] = field(default_factory=list)
    draft_probs: Any = None
    follows: bool = False
    device_drafts: int = 0
    room: int = 0
    reach: int = 0

    @property
    def draft_rows(self) -> int:
        """The rows after the request's last token that verify drafts."""
        return self.device_drafts if self.follows else len(self.drafts)

    @classmethod
    def of(cls, request: Request, start: int, num_new_tokens: int) -> ScheduledRequest:
        return cls(request, start, num_new_tokens, start + num_new_tokens == request.num_tokens, request.epoch)


@dataclass
class SchedulerOutput:
    """The step's batch: decode rows (one new token) first, then prefill chunks. ``scheduled`` is the
    engine's view (with the requests); ``rows`` the same rows as plain data, in the same order, for
    the runner."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rows: tuple[StepRow, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Restore(NamedTuple):
    """Where an admitted request starts: compute from ``first``, keep ``cached`` tokens of its prefix
    hit, and hide keys below ``floor`` from sliding-window attention (0: none)."""

    first: int
    cached: int
    floor: int


@dataclass(frozen=True)
class ReplayStart:
    """The replay planner's decisions at admission (ARCHITECTURE §6).

    ``restore``: where a request resumes when its first ``computed`` tokens are in the cache (a prefix
    hit, or a preempted request's surviving blocks). With per-request state (``stateful``: sliding-window
    rings, compressor windows) the state is rebuilt by recomputing from the plan's ``first_token``; those
    rows do not rewrite the shared blocks (``KVCacheManager.write_floor``). Sliding layers over full paged
    KV (Gemma-3) lose nothing at a hit and replay only for a bounded plan (floor above 0), which they then
    emulate: the hit is cut back to the whole blocks below the plan's first token, so the replayed tokens
    get blocks of their own and every layer recomputes them (the global layers too, unlike a ring model
    whose shared entries stay exact). ``truncation``: the prefill plan, None unless it truncates."""

    planner: ReplayPlanner
    layout: CacheLayout
    stateful: bool = True

    def restore(self, req: Request, computed: int) -> Restore:
        """Where a request with ``computed`` cached tokens (a prefix hit) starts, from the plan for
        reason ``preempted`` (it was preempted before) or ``prefix_hit``."""
        plan = self._plan(req, computed, "preempted" if req.num_preemptions else "prefix_hit")
        first = min(computed, max(0, plan.first_token))
        if not self.stateful:
            if plan.visibility_floor <= 0:
                return Restore(computed, computed, 0)
            first -= first % self.layout.block_size
            return Restore(first, first, min(plan.visibility_floor, first))
        return Restore(first, computed, max(0, min(plan.visibility_floor, first)))

    def truncation(self, req: Request) -> ReplayPlan | None:
        """The plan of the request's prefill (from its computed tokens on), if it truncates."""
        plan = self._plan(req, req.num_computed_tokens, "prefill")
        return None if plan.mode == "full" else plan

    def _plan(self, req: Request, computed: int, reason: Literal["prefill", "prefix_hit", "preempted"]
              ) -> ReplayPlan:
        """The planner's plan for ``req`` resuming from ``computed`` cached tokens, which it gets as
        the ``num_computed_tokens`` of a frozen view (the request itself is not touched)."""
        view = PlannedRequest(req.request_id, req.arrival_time, req.priority, req.num_prompt_tokens,
                              req.num_output_tokens, computed)
        return self.planner.plan(view, self.layout, reason)


@dataclass(frozen=True)
class PlannedRequest:
    """What a replay planner sees of a request (a ``SchedulableRequest``): its fields now, with
    ``num_computed_tokens`` the cached tokens the plan starts from."""

    request_id: str
    arrival_time: float
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int


DraftPlanner = Callable[[Sequence[Request], Collection[str]], dict[str, Drafts]]
"""The drafts each decode request verifies this step (speculative decoding), by request id: the
granted prefix of its live proposal (possibly no token; requests without a proposal are absent). The
second argument names the requests that follow a step in flight: their drafts are on the device
(``Drafts.on_device``), and only their number is granted."""

DraftingPaused = Callable[[str], bool]
"""Whether a request's next proposal is skipped (its drafting is paused, ``Speculator.paused``): such a
request has no drafts to wait for."""


class Scheduler:
    """Owns the waiting and running queues and the KV block tables. With a ``draft_planner``
    (speculative decoding), a decode row also verifies the drafts the planner grants it; blocks are
    allocated for all of them (the worst case: every draft accepted). ``draft_reserve``: positions past
    a sampling row's end that the drafting after the step writes (chained MTP rows,
    ``CommittedRows.chain``); blocks for them are taken where free ones remain, never by preempting."""

    def __init__(self, kv: KVCacheManager, policy: SchedulePolicy, *, max_num_seqs: int,
                 max_num_batched_tokens: int, chunked_prefill: bool,
                 draft_planner: DraftPlanner | None = None, drafting_paused: DraftingPaused | None = None,
                 draft_reserve: int = 0, max_model_len: int = 1 << 62, follow_ups: bool = True,
                 replay: ReplayStart | None = None, share_prefixes: bool = True) -> None:
        self.kv = kv
        self.policy = policy
        self.draft_planner = draft_planner
        self.drafting_paused = drafting_paused
        self.draft_reserve = draft_reserve
        self.max_model_len = max_model_len  # a follow-up row's positions stay below it in the worst case
        # Whether requests follow a step in flight (``_follows``); off where fixing their rows up would read the
        # device (CUDA backends that read a context's host lists: ModelRunner.reads_host_lists).
        self.follow_ups = follow_ups
        self._last_step_verifies = False  # whether the newest scheduled step verifies drafts (_awaits_drafts)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        # The replay planner's restore and prefill truncation (ReplayStart); None: nothing is replayed.
        self.replay = replay
        # In-step prefix sharing (module docstring): hold back requests whose next block is being computed.
        self.share_prefixes = share_prefixes and kv.pool.enable_prefix_caching
        self.num_prefix_holds = 0  # admissions held back for a block in progress (per request and step)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if request.params.prompt_logprobs is None:  # admission looks its prefix up (``_admit``)
            self.kv.prefetch(request.request_id, request.all_token_ids)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick the step's batch, advance its requests optimistically (``advance``) and emit its rows."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        queue = [r for r in self.running if not self._at_limit(r) and not self._awaits_drafts(r)]
        drafts = self._plan_drafts(queue)
        while queue and budget > 0:
            req = queue.pop(0)
            follows = self._follows(req)
            granted = drafts.get(req.request_id)
            if follows:
                # Laid out as if the step in flight accepted none of its drafts (engine/followup.py); the
                # blocks cover the worst case, every one accepted.
                start, num_new = req.num_tokens - 1, 1
                in_flight = req.num_computed_tokens - start  # that step's draft rows
                bound = self.max_model_len - 1 - start - in_flight
                verified = [PENDING] * min(len(granted.tokens) if granted else 0, budget - 1, max(0, bound))
            else:
                start, num_new, in_flight = req.num_computed_tokens, self._chunk(req, budget), 0
                if num_new == 0:
                    break
                verified = list(granted.tokens[:budget - num_new]) if granted is not None else []
            reach = start + num_new + len(verified) + in_flight
            while not self.kv.allocate(req.request_id, reach):
                candidates = [r for r in self.running if r.request_id not in scheduled_ids]
                victim = self.policy.preemption_victim(candidates)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim in queue:
                    queue.remove(victim)
                if victim is req:
                    break
            else:
                if follows:
                    row = ScheduledRequest(req, start, num_new + len(verified), True, req.epoch, follows=True,
                                           device_drafts=len(verified), room=room(req), reach=reach)
                else:
                    row = ScheduledRequest.of(req, start, num_new)
                    row.num_new_tokens, row.drafts, row.reach = num_new + len(verified), verified, reach
                    if granted is not None:
                        row.confidence = list(granted.confidence[:len(verified)])
                        row.raw_confidence = list(granted.raw_confidence[:len(verified)])
                        row.draft_probs = granted.probs
                out.scheduled.append(row)
                scheduled_ids.add(req.request_id)
                budget -= row.num_new_tokens
        if not out.preempted:
            budget = self._admit(out, budget)
        if self.draft_reserve:
            for s in out.scheduled:  # after every row got its blocks: the reserve never takes theirs
                if s.samples:
                    reach = max(s.reach, s.start + s.num_new_tokens)
                    self.kv.allocate(s.request.request_id, reach + self.draft_reserve)
        # Single-token decode rows first: the runner batches them together.
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        out.rows = tuple(self.advance(s) for s in out.scheduled)
        if not out.is_empty:
            self._last_step_verifies = any(s.draft_rows for s in out.scheduled)
        return out

    def advance(self, s: ScheduledRequest) -> StepRow:
        """Advance a scheduled request *optimistically* and return its step row: its computed count
        moves past the step's tokens, and a row that samples gets a ``PENDING`` token at ``token_slot``,
        so the next step can be scheduled before this one's results are read."""
        req = s.request
        req.num_computed_tokens = s.start + s.num_new_tokens
        if s.samples:
            s.token_slot = req.num_tokens
            req.all_token_ids.append(PENDING)
            req.num_pending += 1
        return self._row(s)

    def _row(self, s: ScheduledRequest) -> StepRow:
        """The plain-data copy of an advanced row (``StepRow``)."""
        req, start, end = s.request, s.start, s.start + s.num_new_tokens
        known = end - s.draft_rows  # the request's own tokens; the drafts follow
        first_pending = req.num_tokens - req.num_pending
        pending = first_pending - start if req.num_pending and known > first_pending and not s.follows else -1
        prompt = req.num_prompt_tokens
        targets: tuple[int, ...] = ()
        if req.params.prompt_logprobs is not None and start < prompt - 1:
            targets = tuple(req.prompt_token_ids[start + 1:min(end, prompt - 1) + 1])
        stateful = self.kv.num_state_slots > 0
        # Logits processing rebuilds a request's device counts from these (copied for such rows only).
        processing = s.samples and req.params.processes_logits
        # A follow-up row's tokens are all on the device (engine/followup.py).
        token_ids = (PENDING,) * s.num_new_tokens if s.follows else (*req.all_token_ids[start:known], *s.drafts)
        return StepRow(
            request_id=req.request_id, start=start, num_new_tokens=s.num_new_tokens,
            token_ids=token_ids,
            block_table=tuple(self.kv.table(req.request_id)),
            params=req.params, seed=req.seed, counter=req.num_tokens, num_prompt_tokens=prompt,
            samples=s.samples, token_slot=s.token_slot, epoch=s.epoch, pending_offset=pending,
            prompt_targets=targets, drafts=() if s.follows else tuple(s.drafts), draft_probs=s.draft_probs,
            follows=s.follows, device_drafts=s.device_drafts, room=s.room,
            visibility_floor=req.visibility_floor,
            truncation=req.truncation if start < req.truncation_end else None,
            state_slot=self.kv.state_slot(req.request_id) if stateful else None,
            write_floor=self.kv.write_floor(req.request_id) if stateful else 0,
            grammar=req.grammar,
            prompt_token_ids=tuple(req.prompt_token_ids) if processing else (),
            output_token_ids=tuple(req.all_token_ids[prompt:first_pending]) if processing else (),
            banned_eos=req.banned_eos_ids if processing else frozenset(),
        )

    def _plan_drafts(self, queue: Sequence[Request]) -> dict[str, Drafts]:
        """The drafts each decode request verifies this step, from the draft planner."""
        if self.draft_planner is None:
            return {}
        following = {r.request_id for r in queue if self._follows(r)}
        decoding = [r for r in queue if r.num_computed_tokens == r.num_tokens - 1 or r.request_id in following]
        return self.draft_planner(decoding, following) if decoding else {}

    def _follows(self, req: Request) -> bool:
        """Whether ``req`` gets a follow-up row (``engine/followup.py``): under speculative decoding, a request
        whose previous step is still in flight (an overlapped executor) and whose row needs no host-side
        knowledge of its drafts (grammar masks, logits processing and golden tokens are built on the host
        per draft), when the engine can fix rows up without reading the device (``follow_ups``)."""
        return (self.follow_ups and self.draft_planner is not None and req.num_pending > 0 and req.grammar is None
                and not req.params.processes_logits and not req.params.golden_token_ids)

    def _awaits_drafts(self, req: Request) -> bool:
        """Under speculative decoding a request whose sampled tokens are still unread (an overlapped
        executor's step in flight) and that cannot follow up (``_follows``: structured output, logits
        processing, golden tokens) sits this step out: how many tokens it commits, and so its positions
        and the drafts proposed after them, are known only once that step is processed. Its next step
        then verifies exactly what the synchronous executor's would (plugins/scheduling/README.md). A
        request whose drafting is paused (``drafting_paused``) has nothing to wait for: the proposal
        after its step in flight is skipped, so its next step is a plain decode step, and it is
        scheduled like a request without speculation, unless the step in flight verifies drafts (an
        input token is filled on the device from a plain sampling step's results only)."""
        if self.draft_planner is None or req.num_pending == 0 or self._follows(req):
            return False
        paused = self.drafting_paused is not None and self.drafting_paused(req.request_id)
        return not paused or self._last_step_verifies

    @staticmethod
    def _at_limit(req: Request) -> bool:
        """A request whose in-flight token is its last (under overlap) waits for that result."""
        return req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= req.max_total_tokens

    def _chunk(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.chunked_prefill else 0

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        now = time.monotonic()
        # Hashes of full blocks that requests of this step's batch are computing (in-step prefix sharing).
        in_progress = self._in_progress(out.scheduled) if self.share_prefixes and self.waiting else set()
        for req in self.policy.order(self.waiting, now):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.grammar is not None and not req.grammar.ready:
                continue  # structured output: waits until its grammar has compiled (EngineCore polls it)
            prefix = self.kv.find_prefix(req.request_id, req.all_token_ids) if req.params.prompt_logprobs is None \
                else None
            if prefix is not None and self.share_prefixes and \
                    self.kv.next_block_hash(req.request_id, req.num_tokens, prefix) in in_progress:
                self.num_prefix_holds += 1
                continue  # its next block is being computed in this batch: admitted once it is registered
            computed = prefix.num_tokens if prefix else 0
            # Cached tokens may still be replayed to rebuild per-request state (ReplayStart).
            restore = self.replay.restore(req, computed) if self.replay is not None and computed else None
            start = restore.first if restore else computed
            if prefix is not None and restore is not None and restore.cached < computed:
                computed = restore.cached
                prefix = PrefixHit(prefix.block_ids[:computed // self.kv.block_size], computed)
            remaining = req.num_tokens - start
            num_new = remaining if remaining <= budget else (budget if self.chunked_prefill else 0)
            if num_new == 0 or not self.kv.allocate(req.request_id, max(computed, start + num_new), prefix):
                break
            self.waiting.remove(req)
            if prefix is not None:
                self.kv.record_lookup(req.num_tokens, computed)
            req.num_computed_tokens = start
            req.visibility_floor = restore.floor if restore else 0
            req.truncation = self.replay.truncation(req) if self.replay is not None else None
            req.truncation_end = req.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest.of(req, start, num_new))
            budget -= num_new
            if self.share_prefixes:
                in_progress |= self._in_progress([out.scheduled[-1]])
        return budget

    def _in_progress(self, rows: Sequence[ScheduledRequest]) -> set[bytes]:
        """The hashes of the full blocks (of known tokens) that the requests of ``rows`` compute and the
        prefix cache does not hold yet: their prefill chunks of this step and later steps, and under an
        overlapped executor the blocks of a step in flight (registered when it is processed)."""
        hashes: set[bytes] = set()
        for s in rows:
            req = s.request
            known = req.num_tokens - req.num_pending
            hashes.update(self.kv.uncached_tail(req.request_id, req.all_token_ids, known // self.kv.block_size))
        return hashes

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks now and queue it for recompute. A step still in flight may write
        into those blocks, but steps run in order on the device, so whoever gets them next writes
        after it; the in-flight token is dropped (recomputing gives the same one)."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.drop_pending()
        req.epoch += 1  # its drafts (Speculator.drafts_of) are stale from now on
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------------------------- finish

    def finish(self, req: Request, *, release: bool = True) -> None:
        """Take a finished request out of the queues; release its blocks now, or later with
        ``release_blocks`` when a step in flight may still touch them."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if release:
            self.release_blocks(req)

    def release_blocks(self, req: Request) -> None:
        self.kv.forget(req.request_id)

    def find(self, request_id: str) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None
