"""The core's step primitives (the ``StepContext`` executors compose).

- ``schedule``: pick the batch and advance every scheduled request *optimistically*: its computed
  count moves past this step's tokens, and a request that samples gets a ``PENDING`` token.
- ``prepare``: build the step's tensors on the host; rows whose input is a token of the previous,
  still unread step are matched to that step's sampler rows (the remap).
- ``run``: the device part — fill those rows from the previous step's sampled tokens, forward,
  sample. Nothing here reads the device.
- ``process``: the host reads the step's tokens once, resolves the ``PENDING`` tokens, applies the
  stop rules and builds outputs. Results of requests preempted or finished since they were
  scheduled are dropped; blocks of requests finished while a step is in flight are released when
  that step has been processed.

The synchronous executor runs schedule → prepare → run → process for one step at a time; an
overlapped executor processes step N while step N+1 runs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.engine.drafting import DraftPlan
from deepinfer.engine.followup import FollowUps
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner, StepInputs, StepResults, prompt_logprobs_of
from deepinfer.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from deepinfer.engine.speculation import Speculator
from deepinfer.engine.stats import EngineStats, StepTimer
from deepinfer.engine.structured import StructuredRuntime
from deepinfer.engine.tail_graphs import TailGraphs
from deepinfer.interfaces import StepStats
from deepinfer.model.transfer import to_device
from deepinfer.outputs import FinishReason, RequestOutput
from deepinfer.tokenizer import Tokenizer


@dataclass
class Scheduled:
    """A scheduled step, the timer that follows it through its phases, and (once prepared) the
    row of each sampling request in the step's sampled tokens."""

    batch: SchedulerOutput
    timer: StepTimer
    sampler_rows: dict[str, int] = field(default_factory=dict)
    drafting: DraftPlan | None = None  # the drafting after the step (speculative decoding), once prepared

    @property
    def is_empty(self) -> bool:
        return self.batch.is_empty


@dataclass
class Prepared:
    """Host-built inputs of a step plus the remap onto the previous step's sampled tokens:
    ``fill_rows`` of ``input_ids`` take ``previous.tokens[fill_from]``. ``timer`` is the step's: ``run``
    times its device part as the ``forward`` phase, whichever thread runs it."""

    inputs: StepInputs
    timer: StepTimer
    fill_rows: torch.Tensor | None = None
    fill_from: torch.Tensor | None = None


class EngineCore:
    """Implements ``StepContext`` over one scheduler, one runner and one tokenizer."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Tokenizer | None,
                 stats: EngineStats, on_step_end: Callable[[StepStats], None] | None,
                 on_request_end: Callable[[RequestOutput], None] | None,
                 speculator: Speculator | None = None, tail: TailGraphs | None = None) -> None:
        self.scheduler = scheduler
        self.speculator = speculator
        self.tail = tail  # the speculative tail's CUDA graphs (engine/tail_graphs.py)
        self.runner = runner
        self.tokenizer = tokenizer
        self.stats = stats
        self.on_step_end = on_step_end
        self.on_request_end = on_request_end
        self.stream = False
        self.pending: list[RequestOutput] = []  # outputs of requests finished outside a step (aborts)
        self.inflight: Counter[str] = Counter()  # request id -> scheduled steps not processed yet
        self.awaiting_release: dict[str, Request] = {}  # finished while in flight
        self.followups: dict[str, ScheduledRequest] = {}  # request id -> its follow-up row in flight
        self.structured = StructuredRuntime()  # grammar compilations to poll, step masks to fill
        self._processed_at: float | None = None  # when the last step's results were processed (host clock)

    def has_work(self) -> bool:
        """Requests queued or running, a step whose results are unread, or outputs to flush."""
        return self.scheduler.has_work() or bool(self.inflight) or bool(self.pending)

    # ------------------------------------------------------------------------------------ phases

    def schedule(self) -> Scheduled:
        timer = StepTimer()
        with timer.phase("schedule"):
            self._poll_grammars()
            batch = self.scheduler.schedule()  # advances the requests and emits the step's rows
            for s in batch.scheduled:
                self.inflight[s.request.request_id] += 1
                if s.follows:  # moved when the step it follows is processed
                    self.followups[s.request.request_id] = s
        return Scheduled(batch, timer)

    def prepare(self, scheduled: Scheduled, previous: Scheduled | None = None) -> Prepared:
        """Tensors for ``scheduled``; ``previous`` is the step whose sampled tokens are still unread."""
        with scheduled.timer.phase("prepare"):
            inputs = self.runner.prepare(scheduled.batch.rows)
            scheduled.sampler_rows = {row.request_id: i for i, row in enumerate(inputs.samplers)}
            if self.speculator is not None:
                inputs.drafting = scheduled.drafting = self.speculator.plan_drafting(scheduled.batch, inputs.samplers)
                inputs.followups = self._followups(scheduled, inputs, previous)
            requests = {s.request.request_id: s.request for s in scheduled.batch.scheduled}
            # Grammar bitmasks of structured rows, filled when their tokens are known; a row whose request
            # was preempted or finished since (a newer epoch) is left unfilled.
            self.structured.attach(inputs, lambda row: requests[row.request_id].epoch == row.epoch)
            if self.tail is not None:
                inputs.tail = self.tail.stage(inputs)
            if not inputs.pending_rows:
                return Prepared(inputs, scheduled.timer)
            assert previous is not None, "a pending input token needs the step that sampled it"
            source = [previous.sampler_rows[rid] for rid in inputs.pending_requests]
            device = inputs.input_ids.device
            return Prepared(inputs, scheduled.timer, to_device(inputs.pending_rows, torch.int64, device),
                            to_device(source, torch.int64, device))

    def run(self, prepared: Prepared, previous_results: StepResults | None = None) -> StepResults:
        """Device work of a step: fill pending inputs from ``previous_results``, forward, sample, and draft
        (speculative decoding: ``Speculator.draft``)."""
        with prepared.timer.phase("forward"):
            fill = None
            inputs = prepared.inputs
            if prepared.fill_rows is not None:
                assert previous_results is not None and previous_results.sampled is not None
                fill = (prepared.fill_rows, previous_results.sampled.tokens.index_select(0, prepared.fill_from))
            results = self.runner.execute(inputs, fill, previous_results)
            if self.speculator is not None:
                self.speculator.record_tokens(inputs.input_ids, inputs.ctx)
            if inputs.drafting is not None:
                start = time.perf_counter()
                if inputs.tail is not None:  # verification and drafting in one replay: charged as drafting
                    assert self.tail is not None
                    self.tail.run(inputs.tail, inputs, results)
                else:
                    assert self.speculator is not None
                    results.proposal = self.speculator.draft(inputs.drafting, inputs.input_ids, inputs.ctx,
                                                             results.hidden, results.tokens(inputs.input_ids.device))
                forward, sampler, _ = results.host_split
                results.host_split = (forward, sampler, time.perf_counter() - start)
            results.hidden = None  # read by the drafting alone
            self.runner.seal(results)
            return results

    def execute(self, scheduled: Scheduled) -> StepResults | None:
        """prepare + run for the synchronous path (nothing is in flight)."""
        if scheduled.is_empty:
            return None
        return self.run(self.prepare(scheduled))

    def process(self, scheduled: Scheduled | None, results: StepResults | None) -> list[RequestOutput]:
        """Read a step's results, commit tokens, stop finished requests, return outputs (plus those
        of requests aborted since the last call)."""
        outputs, self.pending = self.pending, []
        if scheduled is None or results is None:
            self.structured.fill_pending()
            return outputs
        batch = scheduled.batch
        with scheduled.timer.phase("sample"):
            emitted, logprob_rows = self._read_tokens(results)  # the step's one read
        busy, idle = self.runner.device_span(results)
        self.stats.device_busy_s += busy
        self.stats.device_idle_s += idle
        verifies = []
        moved: list[tuple[Request, ScheduledRequest, int]] = []  # follow-up rows moved by this step's results
        with scheduled.timer.phase("process"):
            live = [s for s in batch.scheduled if s.request.epoch == s.epoch]
            of_row = {s.request.request_id: s for s in batch.scheduled}
            if results.prompt_spans:
                for row, first, rows in prompt_logprobs_of(results):
                    s = of_row[row.request_id]
                    if s.request.epoch == s.epoch and s.request.prompt_logprobs is not None:
                        s.request.prompt_logprobs[first:first + len(rows)] = rows
            sampled = []
            for i, (row, tokens) in enumerate(zip(results.samplers, emitted, strict=True)):
                s = of_row[row.request_id]
                req = s.request
                if req.epoch != s.epoch:
                    self.followups.pop(req.request_id, None)  # dropped with it (the same epoch change)
                    continue  # preempted or finished since this step was scheduled
                req.all_token_ids[s.token_slot:s.token_slot + 1] = tokens
                req.num_pending -= 1
                later = self.followups.pop(req.request_id, None)
                if later is not None:
                    # Its follow-up row in flight was laid out as if no draft were accepted: it moves by the
                    # accepted count, as the device moved it (engine/followup.py).
                    later.start += len(tokens) - 1
                    later.token_slot += len(tokens) - 1
                    req.num_computed_tokens += len(tokens) - 1
                    moved.append((req, later, len(tokens) - 1))
                elif s.draft_rows:
                    # KV is kept for the last token and the accepted drafts; the rest is rolled back.
                    req.num_computed_tokens = s.start + len(tokens)
                if s.drafts:
                    verifies.append((s, len(tokens) - 1))
                if req.logprobs is not None:
                    req.logprobs.extend(logprob_rows[i])
                sampled.append((s, tokens))
            for s in live:
                req = s.request
                resolved = req.num_tokens - req.num_pending
                self.scheduler.kv.cache_full_blocks(req.request_id, req.all_token_ids,
                                                    min(req.num_computed_tokens, resolved))
            for s in batch.scheduled:
                self.inflight[s.request.request_id] -= 1
                if self.inflight[s.request.request_id] == 0:
                    del self.inflight[s.request.request_id]
                    late = self.awaiting_release.pop(s.request.request_id, None)
                    if late is not None:
                        self.scheduler.release_blocks(late)
            now = time.time()
            drafting = []
            for s, tokens in sampled:
                req = s.request
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                reason = next(((m, r) for m, tok in enumerate(tokens)
                               if (r := self._stop_reason(req, tok, s.token_slot + m + 1)) is not None), None)
                if reason is not None:
                    del req.all_token_ids[s.token_slot + reason[0] + 1:]  # tokens after the stop never count
                    if req.logprobs is not None:
                        del req.logprobs[req.num_output_tokens:]
                    req.num_pending = 0
                    self._finish(req, reason[1])
                    outputs.append(self.output_of(req))
                else:
                    drafting.append(req)
                    if self.stream:
                        outputs.append(self.output_of(req))
            self.stats.steps += 1
            self.stats.generated_tokens += sum(len(tokens) for _, tokens in sampled)
            step_verifies = tuple(verifies)
            if results.proposal is not None:
                assert self.speculator is not None
                self.speculator.keep(results.proposal, {r.request_id: r for r in drafting})
                for req, later, accepted in moved:  # the drafts each follow-up row verifies, for statistics
                    drafts = self.speculator.drafts_of(req) if not req.finished else None
                    if drafts is not None:
                        n = min(later.device_drafts, max(0, later.room - accepted), len(drafts.tokens))
                        later.drafts = list(drafts.tokens[:n])
                        later.confidence = list(drafts.confidence[:n])
                        later.raw_confidence = list(drafts.raw_confidence[:n])
        for name, secs in scheduled.timer.seconds.items():
            self.stats.phase_seconds[name] += secs
        if self.speculator is not None:
            forward, sampler, draft_seconds = results.time_split()
            drafted = len(results.proposal.plan.samplers) if results.proposal is not None else 0
            now = time.perf_counter()  # a step's wall time: from the step before's processing to this one's
            since = now - self._processed_at if self._processed_at is not None else None
            self._processed_at = now
            self.speculator.observe_step(batch, forward, sampler, drafted, draft_seconds, since)
        self.structured.fill_pending()  # phase 4: masks of the step in flight, from the advanced matchers
        if self.on_step_end is not None:
            self.on_step_end(self._step_stats(batch, scheduled.timer, step_verifies))
        return outputs

    # ---------------------------------------------------------------------------------------- helpers

    @staticmethod
    def _followups(scheduled: Scheduled, inputs: StepInputs, previous: Scheduled | None) -> FollowUps | None:
        """The step's follow-up rows (``engine/followup.py``), matched to the previous step's sampling rows
        and proposal rows; None without any."""
        rows = scheduled.batch.rows
        if not any(row.follows for row in rows):
            return None
        assert previous is not None, "a follow-up row needs the step before it"
        proposal_row = {rid: i for i, rid in enumerate(previous.drafting.request_ids)} if previous.drafting else {}
        random_row: dict[int, int] = {}
        for i, row in enumerate(inputs.samplers):
            if not row.params.greedy:
                random_row[i] = len(random_row)
        f = FollowUps([], [], [], [], [], [], [], [])
        first = 0
        for index, row in enumerate(rows):
            if row.follows:
                sampler = scheduled.sampler_rows[row.request_id]
                f.token_rows.append(first)
                f.requests.append(index)
                f.samplers.append(sampler)
                f.random.append(random_row.get(sampler, -1))
                f.sources.append(previous.sampler_rows[row.request_id])
                f.proposal_rows.append(proposal_row.get(row.request_id, -1))
                f.drafts.append(row.device_drafts)
                f.rooms.append(row.room)
            first += row.num_new_tokens
        return f

    def _poll_grammars(self) -> None:
        """Finish the waiting requests whose grammar failed to compile or timed out (only them); when
        every queued request waits for its grammar and nothing runs, wait for one briefly rather than spin."""
        for req in self.structured.poll(list(self.scheduler.waiting)):
            self._finish(req, "error", req.grammar.error)
            self.pending.append(self.output_of(req))
        if not self.scheduler.running and not self.inflight and not self.pending:
            self.structured.wait_for_compilation(self.scheduler.waiting)

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Finish a request; its blocks are released now unless a step in flight still uses them."""
        if reason == "error" and error is None and req.grammar is not None:
            error = req.grammar.error  # set by the grammar that refused a token (``_stop_reason``)
        req.finish(reason, error)
        self.runner.release_request(req.request_id)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        in_flight = self.inflight[req.request_id] > 0
        self.scheduler.finish(req, release=not in_flight)
        if in_flight:
            self.awaiting_release[req.request_id] = req

    @staticmethod
    def _read_tokens(results: StepResults) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
        """Per sampling request, the tokens the step emitted (one, or the accepted drafts plus the
        final token under speculative decoding) and their logprob rows (empty lists when none were
        asked for). Reads the device."""
        sampled, verified = results.host_results()
        if verified is not None:
            v = verified
            counts = v.num_accepted.tolist()
            emitted = [row[:a + 1] for row, a in zip(v.tokens.tolist(), counts, strict=True)]
            lps, flat_tokens = v.token_logprobs, [t for row in emitted for t in row]
            row_of = [i for i, row in enumerate(emitted) for _ in row]
            starts = [0]
            for s in results.samplers:
                starts.append(starts[-1] + 1 + s.draft_rows)
            rows = [starts[i] + m for i, row in enumerate(emitted) for m in range(len(row))]
        elif sampled is not None:
            emitted = [[t] for t in sampled.tokens.tolist()]
            lps, flat_tokens, row_of, rows = sampled.token_logprobs, [r[0] for r in emitted], \
                list(range(len(emitted))), list(range(len(emitted)))
        else:
            return [], []
        logprob_rows: list[list[dict[int, float]]] = [[] for _ in emitted]
        if lps is None:
            return emitted, logprob_rows
        src = verified if verified is not None else sampled
        assert src is not None and src.top_logprobs is not None and src.top_ids is not None
        index = torch.tensor(rows, dtype=torch.int64, device=lps.device)
        for i, tok, lp, top_lp, top_ids in zip(row_of, flat_tokens, lps.index_select(0, index).tolist(),
                                               src.top_logprobs.index_select(0, index).tolist(),
                                               src.top_ids.index_select(0, index).tolist(), strict=True):
            n = results.samplers[i].params.logprobs or 0
            entry = dict(zip(top_ids[:n], top_lp[:n], strict=True))
            entry[tok] = lp
            logprob_rows[i].append(entry)
        return emitted, logprob_rows

    def _stop_reason(self, req: Request, token: int, length: int) -> FinishReason | None:
        """Why the request stops after its token at index ``length − 1`` (None: it goes on).
        Called once per committed token, in order, so it also advances the request's grammar."""
        if req.grammar is not None and not self.structured.commit(req, token):
            return "error"
        if token in req.eos_token_ids or token in req.stop_token_ids or self.structured.terminated(req):
            return "stop"
        if req.params.stop and self.tokenizer is not None and self._hit_stop_string(req, length):
            return "stop"
        if length - req.num_prompt_tokens >= req.params.max_tokens or length >= req.max_total_tokens:
            return "length"
        return None

    def _hit_stop_string(self, req: Request, length: int) -> bool:
        assert self.tokenizer is not None
        text = self.tokenizer.decode(req.all_token_ids[req.num_prompt_tokens:length])
        cut = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
        if cut:
            req.stop_text_len = min(cut)
            return True
        return False

    def output_of(self, req: Request) -> RequestOutput:
        """The request's output now; ``text`` is decoded here, cut at a matched stop string."""
        text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else ""
        if req.stop_text_len is not None:
            text = text[: req.stop_text_len]
        output = req.to_output(text)
        if req.finished and self.on_request_end is not None:
            self.on_request_end(output)
        return output

    def abort(self, request_id: str) -> bool:
        """Finish a queued or running request with ``finish_reason="abort"``; its output is returned
        by the next step. Returns False if no such request is live."""
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        self.pending.append(self.output_of(req))
        return True

    def abort_after_failed_step(self, error: str) -> list[str]:
        """Bring the core back to a clean state after a step raised (a ``KeyboardInterrupt``, a plugin
        that failed) at any point between ``schedule`` and the end of ``process``; the executor has
        already dropped its steps in flight. A half-done step leaves optimistic state that no later
        ``process`` will resolve (pending tokens, advanced computed counts, steps counted in flight), so
        every live request is finished with ``finish_reason="abort"`` and ``error``, every block and
        state slot is released, including those of a request caught between the queues, and the prefix
        cache forgets its hashes (a block registered for a step that never ran would be a wrong hit).
        Their outputs are returned by the next step. Returns the aborted request ids."""
        self.inflight.clear()
        self.followups.clear()
        for req in self.awaiting_release.values():
            self.scheduler.release_blocks(req)
        self.awaiting_release.clear()
        self.structured.unfilled.clear()
        live = [*self.scheduler.running, *self.scheduler.waiting]
        for req in live:
            self._finish(req, "abort", error)
            self.pending.append(self.output_of(req))
        kv = self.scheduler.kv
        for request_id in list(kv.tables):  # e.g. admitted (blocks taken) but not yet in ``running``
            kv.forget(request_id)
        for request_id in list(kv.slots):
            kv.free(request_id)
        kv.pool.clear_cache()
        self.runner.work_drained()
        return [r.request_id for r in live]

    def _step_stats(self, batch: SchedulerOutput, timer: StepTimer,
                    verifies: tuple[tuple[ScheduledRequest, int], ...]) -> StepStats:
        decode = sum(s.num_new_tokens for s in batch.scheduled if s.samples and s.num_new_tokens == 1 + s.draft_rows)
        return StepStats(
            step=self.stats.steps,
            num_requests=len(batch.scheduled),
            num_prefill_tokens=batch.num_tokens - decode,
            num_decode_tokens=decode,
            timings=dict(timer.seconds),
            verified_drafts=tuple(len(s.drafts) for s, _ in verifies),
            accepted_drafts=tuple(a for _, a in verifies),
            draft_confidence=tuple(tuple(s.confidence) for s, _ in verifies),
            draft_raw_confidence=tuple(tuple(s.raw_confidence) for s, _ in verifies),
            router_loads=self._router_loads(),
        )

    def _router_loads(self) -> torch.Tensor | None:
        """Tokens per expert per MoE layer since the previous call (a model's ``take_router_stats``,
        on its device; None for dense models). With an overlapped executor the next step's forward
        may already be counted."""
        take = getattr(getattr(self.runner, "model", None), "take_router_stats", None)
        return take() if take is not None else None
