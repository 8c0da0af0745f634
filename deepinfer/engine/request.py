"""A request's mutable state inside the engine."""

from __future__ import annotations

import enum
import time
from typing import Any

from deepinfer.interfaces import ReplayPlan
from deepinfer.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput, TokenLogprobs
from deepinfer.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PENDING = -1  # a sampled token whose value is still on the device (overlapped execution)


class Request:
    """Tokens, progress and lifecycle of one request.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the cache (or is being computed
    by a step in flight). The tokens still to compute are ``all_token_ids[num_computed_tokens:]``;
    when they are all computed, the step's logits give the next token. A token sampled by a step
    whose results the host has not read yet stands in ``all_token_ids`` as ``PENDING``
    (``num_pending`` of them, always at the end). ``epoch`` changes whenever the request is
    preempted or finished, so results of steps scheduled before that are recognised and dropped.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, eos_token_ids: frozenset[int],
                 max_total_tokens: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seed = seed
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        # The tokens ``first_n_token_no_eos`` bans from the first output tokens (ignore_eos or not).
        self.banned_eos_ids = frozenset({params.eos_id}) if params.eos_id is not None else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_total_tokens = max_total_tokens
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic()
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.stop_text_len: int | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.num_preemptions = 0
        self.num_pending = 0
        self.epoch = 0
        # Structured output: the request's grammar (``deepinfer.structured.grammar.RequestGrammar``), set by
        # the engine when the params ask for one; the scheduler admits the request once it is ready.
        self.grammar: Any = None
        # Bounded replay (ReplayStart, engine/scheduler.py), set at each admission: the position below which
        # sliding-window attention sees nothing (a bounded restore; 0: none), and the YoCo truncation plan
        # (None: none) of the prefill that ends at ``truncation_end`` (the request's length when admitted).
        self.visibility_floor = 0
        self.truncation: ReplayPlan | None = None
        self.truncation_end = 0

    # SchedulableRequest view ------------------------------------------------------------------------
    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens whose values are known (pending ones excluded)."""
        return self.all_token_ids[len(self.prompt_token_ids):len(self.all_token_ids) - self.num_pending]

    def drop_pending(self) -> None:
        """Forget tokens still on the device (their step's results will be discarded)."""
        if self.num_pending:
            del self.all_token_ids[-self.num_pending:]
            self.num_pending = 0

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.drop_pending()
        self.epoch += 1
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.metrics.finish_time = time.time()

    def to_output(self, text: str) -> RequestOutput:
        completion = CompletionOutput(
            text=text,
            token_ids=self.output_token_ids,
            finish_reason=self.finish_reason,
            logprobs=self.logprobs,
            error=self.error,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
        )
