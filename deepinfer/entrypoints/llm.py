"""The offline API: ``LLM(model, **overrides).generate(prompts, params)`` (API.md §4)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from deepinfer.config import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import Request
from deepinfer.engine.teacher import TeacherForcing, teacher_force
from deepinfer.errors import DeepInferError
from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams

Prompt = str | list[int]
Message = Mapping[str, Any]


class ModelFacts(Protocol):
    """What callers of an ``Engine`` read of its model (a ``ParallelEngine`` holds only this)."""

    vocab_size: int


class Engine(Protocol):
    """What ``LLM``, ``AsyncLLM`` and ``deepinfer bench`` drive: an ``LLMEngine`` (one process) or a
    ``ParallelEngine`` (ranks; ``device`` and ``dtype`` are rank 0's). ``stream`` on makes ``step()`` also
    return the output of every unfinished request that got tokens; ``get_stats()`` has the keys of
    API.md §4."""

    tokenizer: Any
    model_path: Path
    max_model_len: int
    config: EngineConfig
    model: ModelFacts
    device: torch.device
    dtype: torch.dtype
    stream: bool

    def make_request(self, prompt: str | list[int], params: SamplingParams, *,
                     text: str | None = None) -> Request: ...

    def add(self, request: Request) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def get_stats(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


def create_engine(model: str | None, config: Any, overrides: Mapping[str, Any]) -> Engine:
    """The engine a config asks for: one process, N rank processes driven from here
    (``expert_parallel_size=N``), or this process as one ``torchrun`` rank."""
    from deepinfer.parallel.launch import requested_world_size, torchrun_launch

    world, launch = requested_world_size(model, config, overrides), torchrun_launch()
    if launch is not None and max(world, launch.world) > 1:
        from deepinfer.parallel.torchrun import TorchrunEngine

        # torchrun started the ranks: this process is one of them (SPMD, API.md §4).
        return TorchrunEngine(model, launch=launch, config=config, overrides=overrides)
    if world > 1:
        from deepinfer.parallel.driver import ParallelEngine

        # N rank processes (DP attention + EP MoE), driven from here (API.md §4).
        return ParallelEngine(model, config=config, overrides=overrides)
    return LLMEngine(model, config=config, overrides=overrides)


def _as_prompt_list(prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [list(items)]  # one prompt of token ids
    return [p if isinstance(p, str) else list(p) for p in items]


class LLM:
    """Offline generation with continuous batching.

    ``model`` is an HF folder or an alias (``smollm2-135m-instruct``); ``config`` a YAML/JSON path
    or dict; ``overrides`` flat fields (``dtype``, ``device``, ``max_num_seqs``, …) or whole sections
    (``cache=``, ``scheduler=``, ``plugins=``, ``model_config=``, …), highest precedence.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, config: Any = None,
                 **overrides: Any) -> None:
        from deepinfer.config import overrides_to_tree

        self.engine: Engine = create_engine(None if model is None else str(model), config,
                                            overrides_to_tree(overrides))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Invalid prompts or params
        raise ``ValueError`` before anything is queued."""
        items = _as_prompt_list(prompts)
        params = self._params_for(len(items), sampling_params)
        requests = [self.engine.make_request(p, sp) for p, sp in zip(items, params, strict=True)]
        return self._run(requests, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies: one conversation (a list of ``{"role", "content"}``) or a list of them,
        rendered with the model's chat template (generation prompt on) and tokenized without adding
        special tokens. ``chat_template_kwargs`` are extra template variables; with
        ``tokenizer="deepseek-v4"`` they are the V4 encoding's options, e.g. ``{"thinking": True}``."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"chat() needs a tokenizer; {str(self.engine.model_path)!r} has none")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        options = dict(chat_template_kwargs or {})
        encoded = [tokenizer.encode_chat([dict(m) for m in conv], **options) for conv in conversations]
        params = self._params_for(len(encoded), sampling_params)
        requests = [self.engine.make_request(ids, sp, text=text)
                    for (text, ids), sp in zip(encoded, params, strict=True)]
        return self._run(requests, use_tqdm)

    @staticmethod
    def _params_for(n: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        return params

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        for req in requests:
            self.engine.add(req)
        wanted = {r.request_id for r in requests}
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while len(done) < len(requests):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[r.request_id] for r in requests]

    def teacher_force(self, sequences: Sequence[Sequence[int]], *, top_k: int = 32,
                      layers: Sequence[int] = (), max_tokens: int = 4096,
                      use_tqdm: bool = False) -> list[TeacherForcing]:
        """The model's ``top_k`` next-token logits at every position of each token sequence, and the inputs
        of ``layers`` (``deepinfer.engine.teacher``), with nothing else in flight; for drafter training and
        evaluation. Not available for ranks (``expert_parallel_size`` > 1)."""
        if not isinstance(self.engine, LLMEngine):
            raise DeepInferError("teacher_force runs in a single-process engine (expert_parallel_size = 1)")
        with tqdm(total=len(sequences), desc="teacher-force", disable=not use_tqdm, unit="seq") as bar:
            return teacher_force(self.engine, sequences, top_k=top_k, layers=layers, max_tokens=max_tokens,
                                 progress=bar.update)

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request; it finishes with ``finish_reason="abort"``."""
        return self.engine.abort(request_id)

    def get_stats(self) -> dict[str, Any]:
        """Cumulative counters (API.md §4) plus one sub-dict per enabled plugin."""
        return self.engine.get_stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
