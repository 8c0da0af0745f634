"""The core's step primitives (the ``StepContext`` executors compose): schedule, execute, process.

``process`` is where the host reads a step's results: it advances each request, appends sampled
tokens, applies the stop rules, frees finished requests' blocks and builds their outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.engine.outputs import FinishReason, RequestOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer.engine.stats import EngineStats, StepTimer
from deepinfer.interfaces import StepStats
from deepinfer.model.runner import ModelRunner, StepResults, prompt_logprobs_of
from deepinfer.tokenizer import Tokenizer


@dataclass
class Scheduled:
    """A scheduled step and the timer that follows it through its phases."""

    batch: SchedulerOutput
    timer: StepTimer


class EngineCore:
    """Implements ``StepContext`` over one scheduler, one runner and one tokenizer."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer: Tokenizer | None,
                 stats: EngineStats, on_step_end: Callable[[StepStats], None] | None,
                 on_request_end: Callable[[RequestOutput], None] | None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.stats = stats
        self.on_step_end = on_step_end
        self.on_request_end = on_request_end
        self.stream = False
        self.pending: list[RequestOutput] = []  # outputs of requests finished outside a step (aborts)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.pending)

    def schedule(self) -> Scheduled:
        timer = StepTimer()
        with timer.phase("schedule"):
            batch = self.scheduler.schedule()
        return Scheduled(batch, timer)

    def execute(self, scheduled: Scheduled) -> StepResults | None:
        if scheduled.batch.is_empty:
            return None
        with scheduled.timer.phase("prepare"):
            inputs = self.runner.prepare(scheduled.batch, self.scheduler.kv.table)
        with scheduled.timer.phase("forward"):
            return self.runner.execute(inputs)

    def process(self, scheduled: Scheduled, results: StepResults | None) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        if results is None:
            return outputs
        batch = scheduled.batch
        num_decodes = sum(1 for s in batch.scheduled if s.num_new_tokens == 1 and s.samples)  # before appending
        with scheduled.timer.phase("sample"):
            tokens = results.sampled.tokens.tolist() if results.sampled is not None else []  # the step's one read
        with scheduled.timer.phase("process"):
            if results.prompt_spans:
                for s, first, rows in prompt_logprobs_of(results):
                    plp = s.request.prompt_logprobs
                    assert plp is not None
                    plp[first:first + len(rows)] = rows
            for s in batch.scheduled:
                req = s.request
                req.num_computed_tokens = s.start + s.num_new_tokens
                self.scheduler.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            logprob_rows = self._logprob_rows(results)
            now = time.time()
            for i, (s, token) in enumerate(zip(results.samplers, tokens, strict=True)):
                req = s.request
                req.all_token_ids.append(token)
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                if req.logprobs is not None:
                    req.logprobs.append(logprob_rows[i])
                reason = self._stop_reason(req, token)
                if reason is not None:
                    req.finish(reason)
                    self.scheduler.finish(req)
                    outputs.append(self.output_of(req))
                elif self.stream:
                    outputs.append(self.output_of(req))
            self.stats.steps += 1
            self.stats.generated_tokens += len(tokens)
        for name, secs in scheduled.timer.seconds.items():
            self.stats.phase_seconds[name] += secs
        if self.on_step_end is not None:
            self.on_step_end(self._step_stats(batch, scheduled.timer, num_decodes))
        return outputs

    # ---------------------------------------------------------------------------------------- helpers

    @staticmethod
    def _logprob_rows(results: StepResults) -> list[dict[int, float]]:
        sampled = results.sampled
        if sampled is None or sampled.token_logprobs is None:
            return []
        rows = []
        for s, tok, lp, top_lp, top_ids in zip(results.samplers, sampled.tokens.tolist(),
                                               sampled.token_logprobs.tolist(), sampled.top_logprobs.tolist(),
                                               sampled.top_ids.tolist(), strict=True):
            n = s.request.params.logprobs or 0
            row = dict(zip(top_ids[:n], top_lp[:n], strict=True))
            row[tok] = lp
            rows.append(row)
        return rows

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        if token in req.eos_token_ids or token in req.stop_token_ids:
            return "stop"
        if req.params.stop and self.tokenizer is not None and self._hit_stop_string(req):
            return "stop"
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= req.max_total_tokens:
            return "length"
        return None

    def _hit_stop_string(self, req: Request) -> bool:
        assert self.tokenizer is not None
        text = self.tokenizer.decode(req.output_token_ids)
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
        req.finish("abort")
        self.scheduler.finish(req)
        self.pending.append(self.output_of(req))
        return True

    def _step_stats(self, batch: SchedulerOutput, timer: StepTimer, decode: int) -> StepStats:
        return StepStats(
            step=self.stats.steps,
            num_requests=len(batch.scheduled),
            num_prefill_tokens=batch.num_tokens - decode,
            num_decode_tokens=decode,
            timings=dict(timer.seconds),
        )
