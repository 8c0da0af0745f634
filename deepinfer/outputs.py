"""What a request returns (API.md §4 ``RequestOutput``), and what ``deepinfer_request_end`` carries.

Public and below the engine: the hook contract (``hookspecs.py``, ``interfaces.py``) names these types,
and a plugin reads them, without importing ``engine/``. Plain dataclasses of plain values; nothing here
imports the rest of deepinfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]
# One position's log-probabilities: token id -> logprob (the top-n plus the chosen token).
TokenLogprobs = dict[int, float]


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``, seconds) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class ToolCall:
    """One function call parsed from a chat reply: ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass
class CompletionOutput:
    """The generated continuation. ``text`` has any matched stop string cut off; ``token_ids``
    keep the EOS token when the request stopped on it.

    A chat reply of a model whose output is parsed (``tokenizer="deepseek-v4"``: deepseek-recipe's stream
    processor) has ``text`` = the answer content alone, ``reasoning`` = the thinking (None outside
    thinking mode) and ``tool_calls`` = the parsed calls (None when there are none)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


@dataclass
class RequestOutput:
    """One request's result (or its progress so far, when streaming)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text
