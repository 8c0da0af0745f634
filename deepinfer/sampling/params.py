"""``SamplingParams``: how one request samples and when it stops (API.md §4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.structured.spec import GrammarSpec, parse_spec

_INT64_MAX = 2**63 - 1
# The OpenAI range, the same offline and in the server (``server/protocol.py``).
MAX_TEMPERATURE = 2.0
# Below this a temperature is greedy, as in the reference: dividing logits by a smaller one overflows float32.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ``ValueError`` naming the field.

    ``temperature`` in [0, 2]; 0 (or anything below 1e-5, ``GREEDY_BELOW``) means argmax. ``top_k`` −1 or
    0 disables top-k; ``top_p`` in (0, 1] (the top token is always kept, however small ``top_p``);
    ``min_p`` in [0, 1] keeps tokens whose probability is at least ``min_p`` × the top one.
    ``seed`` (alias ``seq_seed``) makes the request's draws a pure function of (seed, position), so
    the tokens never depend on the rest of the batch. ``priority``: lower is served first (with a
    priority scheduling policy). ``logprobs``/``prompt_logprobs``: top-n log-probabilities of the
    model's raw distribution per generated / prompt token, plus the chosen token's.
    ``structured``: exactly one of ``json_schema`` (dict or str), ``regex``, ``ebnf``, ``choice`` (list of
    str); ``so_args={"schema_type": "json"|"regex"|"ebnf", "schema": ...}`` is the reference's form
    of the same (both: error). A grammar that fails to compile finishes only its request, with
    ``finish_reason="error"`` (API.md §4).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)  # also a str (one stop string) or None (none)
    stop_token_ids: list[int] = field(default_factory=list)  # also None (none)
    ignore_eos: bool = False
    priority: int = 0
    seed: int | None = None
    seq_seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: dict[str, Any] | None = None
    so_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.seq_seed is not None:
            if self.seed is not None and self.seed != self.seq_seed:
                raise ValueError(
                    f"SamplingParams: seed={self.seed} and seq_seed={self.seq_seed} differ; seq_seed is an "
                    "alias of seed, give one of them"
                )
            self.seed = self.seq_seed
        self.seq_seed = self.seed
        # ``None`` means none (as in vLLM and the OpenAI API); a str is one stop string.
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"SamplingParams.{name} must be a list (or None), got {getattr(self, name)!r:.80}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"a number in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_BELOW:g}: greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an int >= 1, or -1 / 0 to disable")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not _is_int(self.priority):
            raise bad("priority", "an int")
        if self.seed is not None and (not _is_int(self.seed) or not -_INT64_MAX - 1 <= self.seed <= _INT64_MAX):
            raise bad("seed", "an int in the int64 range, or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= 1000):
                raise bad(name, "None or an int in [0, 1000]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative ints")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "True or False")
        parse_spec(self.structured, self.so_args)  # the form only; the grammar compiles in the engine

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        """The structured-output request in one form (``structured`` or ``so_args``), or None."""
        return parse_spec(self.structured, self.so_args)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one so small (< ``GREEDY_BELOW``) that it is argmax anyway."""
        return self.temperature < GREEDY_BELOW

    @property
    def needs_sorting(self) -> bool:
        """Whether the sampler must sort this row's logits (top-k or top-p active)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
