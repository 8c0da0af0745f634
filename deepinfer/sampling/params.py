"""``SamplingParams``: how one request samples and when it stops (API.md §4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.structured.spec import GrammarSpec, parse_spec

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1
# The OpenAI range, the same offline and in the server (``server/protocol.py``).
MAX_TEMPERATURE = 2.0
# Below this a temperature is greedy, as in the reference: dividing logits by a smaller one overflows float32.
GREEDY_BELOW = 1e-5
PENALTY_RANGE = 2.0  # presence/frequency penalties lie in [-2, 2] (OpenAI's range)
LOGIT_BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)


@dataclass
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ``ValueError`` naming the field.

    ``temperature`` in [0, 2]; 0 (or anything below 1e-5, ``GREEDY_BELOW``) means argmax. ``top_k`` −1 or
    0 disables top-k; ``top_p`` in (0, 1] (the top token is always kept, however small ``top_p``);
    ``min_p`` in [0, 1] keeps tokens whose probability is at least ``min_p`` × the top one.
    ``seed`` (alias ``seq_seed``) makes the request's draws a pure function of (seed, position), so
    the tokens never depend on the rest of the batch; any int in [−2^63, 2^64) (the reference's
    ``seq_seed`` is a uint64; a negative seed is the same as ``seed + 2^64``). ``priority``: lower is
    served first (with a priority scheduling policy). ``logprobs``/``prompt_logprobs``: top-n log-probabilities of the
    model's raw distribution per generated / prompt token, plus the chosen token's.
    ``structured``: exactly one of ``json_schema`` (dict or str), ``regex``, ``ebnf``, ``choice`` (list of
    str); ``so_args={"schema_type": "json"|"regex"|"ebnf", "schema": ...}`` is the reference's form
    of the same (both: error). A grammar that fails to compile finishes only its request, with
    ``finish_reason="error"`` (API.md §4). ``so_args`` may add ``trigger_token_ids`` (the grammar
    starts after that token sequence has been generated; before it, generation is free) and
    ``bound_token_id`` (once that token is generated, the rest of the trigger is forced and the
    grammar follows), as the reference's matcher does.

    Logits processing (vLLM's and OpenAI's names; ``sampling/penalties.py``), applied on the device
    in this order: ``logit_bias`` ({token id: bias in [−100, 100]}, added to the logits) and
    ``allowed_token_ids`` (only these may be sampled); ``repetition_penalty`` (> 0, 1 = off:
    positive logits of tokens seen in the prompt or the output are divided by it, negative ones
    multiplied); ``frequency_penalty`` and ``presence_penalty`` (in [−2, 2]: subtract penalty ×
    the token's count in the output, and penalty × (count > 0)); ``first_n_token_no_eos``: EOS
    cannot be sampled as one of the first n output tokens (the reference's name; ``eos_id`` names
    the token banned, None = the model's EOS ids). Greedy requests are penalized too.

    ``golden_token_ids`` (the reference's teacher forcing, for evaluation): output token m is
    ``golden_token_ids[m]`` whatever the model says, for m < its length (logprobs score it under
    the model); under speculative decoding a draft is accepted when it equals the forced token. With
    structured output the forced tokens still advance the grammar: one it refuses ends the request
    with ``finish_reason="error"``.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    first_n_token_no_eos: int = 0
    eos_id: int | None = None
    golden_token_ids: list[int] | None = None

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
        self._validate_processing()

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
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _UINT64_MAX):
            raise bad("seed", "an int in [-2**63, 2**64) (uint64, or int64 two's complement), or None")
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

    def _validate_processing(self) -> None:
        """The logits-processing and teacher-forcing fields (vocabulary bounds are checked by the engine)."""
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise bad(name, f"a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 = off)")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "a finite number > 0 (1 = off)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(k) and k >= 0 and _is_number(v) and -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE
                    for k, v in self.logit_bias.items()):
                raise bad("logit_bias", f"a dict of token id (int >= 0) -> number in [-{LOGIT_BIAS_RANGE:g}, "
                                        f"{LOGIT_BIAS_RANGE:g}], or None")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                    or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
                raise bad("allowed_token_ids", "a non-empty list of non-negative ints, or None")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if not _is_int(self.first_n_token_no_eos) or self.first_n_token_no_eos < 0:
            raise bad("first_n_token_no_eos", "an int >= 0 (0 = off)")
        if self.eos_id is not None and (not _is_int(self.eos_id) or self.eos_id < 0):
            raise bad("eos_id", "a token id (int >= 0), or None for the model's EOS ids")
        if self.golden_token_ids is not None:
            if (not isinstance(self.golden_token_ids, (list, tuple))
                    or not all(_is_int(t) and t >= 0 for t in self.golden_token_ids)):
                raise bad("golden_token_ids", "a list of non-negative ints, or None")
            self.golden_token_ids = list(self.golden_token_ids)

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """Token ids of the params by field, for the engine's vocabulary check."""
        fields = {"stop_token_ids": self.stop_token_ids, "logit_bias": sorted(self.logit_bias or {}),
                  "allowed_token_ids": self.allowed_token_ids or [], "golden_token_ids": self.golden_token_ids or [],
                  "eos_id": [] if self.eos_id is None else [self.eos_id]}
        spec = self.grammar_spec
        if spec is not None:
            fields["so_args['trigger_token_ids'/'bound_token_id']"] = [*spec.trigger,
                                                                     *([] if spec.bound is None else [spec.bound])]
        return {name: ids for name, ids in fields.items() if ids}

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler must adjust this request's logits (``sampling/penalties.py``)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.allowed_token_ids is not None or self.first_n_token_no_eos > 0)

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
