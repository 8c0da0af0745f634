"""The offline API: ``LLM(model, **overrides).generate(prompts, params)`` (API.md §4)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from deepinfer.chat_output import ChatPrompt, encode_chat, parse_reply
from deepinfer.config import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.intake import RequestIntake
from deepinfer.engine.request import Request
from deepinfer.engine.teacher import TeacherForcing, teacher_force
from deepinfer.errors import DeepInferError
from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams

Prompt = str | list[int]
Message = Mapping[str, Any]


class Engine(Protocol):
    """What ``LLM``, ``AsyncLLM`` and ``deepinfer bench`` drive: an ``LLMEngine`` (one process) or a
    ``ParallelEngine`` (ranks; ``device`` and ``dtype`` are rank 0's). ``stream`` on makes ``step()`` also
    return the output of every unfinished request that got tokens; ``get_stats()`` has the keys of
    API.md §4."""

    tokenizer: Any
    model_path: Path
    max_model_len: int
    config: EngineConfig
    intake: RequestIntake  # the model's facts requests are checked against (vocab_size, max_model_len)
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
    """``prompts`` as a list of prompts (str, or a list of token ids); ``ValueError`` naming the argument
    for anything else (bytes are refused: their items are ints, but they are text, not token ids)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a str, a list of token ids, or a list of those; got "
                         f"{type(prompts).__name__}{_BYTES_HINT if isinstance(prompts, bytes | bytearray) else ''}")
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [list(items)]  # one prompt of token ids
    out: list[Prompt] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, (list, tuple)):
            out.append(list(p))
        else:
            raise ValueError(f"prompts[{i}] must be a str or a list of token ids, got {type(p).__name__}"
                             f"{_BYTES_HINT if isinstance(p, bytes | bytearray) else ''}")
    return out


def _apply_reply(chat: ChatPrompt, params: SamplingParams, out: RequestOutput, eos_ids: frozenset[int]) -> None:
    """Replace a parsed chat reply's raw text by its content, with its reasoning and tool calls beside it."""
    comp = out.outputs[0]
    if comp.finish_reason == "error":
        return  # nothing finished to parse; the error says what happened
    reply = parse_reply(chat, comp.token_ids, comp.finish_reason,
                        skip_ids=eos_ids | frozenset(params.stop_token_ids), stop=params.stop)
    if reply is not None:
        comp.text = reply.content or ""
        comp.reasoning = reply.reasoning
        comp.tool_calls = reply.tool_calls or None


_BYTES_HINT = " (bytes are not taken as token ids: decode them to str, or pass a list of ints)"


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
        ``tokenizer="deepseek-v4"`` they are the V4 encoding's options, e.g. ``{"thinking": True}``, and
        each reply is parsed by deepseek-recipe's stream processor: ``outputs[0].text`` is the answer
        content, ``.reasoning`` the thinking, ``.tool_calls`` the parsed calls (``chat_output.py``). The
        recipe's thinking-mode sampling rule (temperature and top_p 1.0) is the server's to apply; here the
        given ``sampling_params`` are used as they are."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"chat() needs a tokenizer; {str(self.engine.model_path)!r} has none")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} mappings (or a list of "
                             f"such lists), got {messages!r:.80}")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        for i, conv in enumerate(conversations):
            if not isinstance(conv, (list, tuple)) or not all(isinstance(m, Mapping) for m in conv):
                raise ValueError(f"messages: conversation {i} must be a list of {{'role', 'content'}} mappings, "
                                 f"got {conv!r:.80}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be a mapping, got {type(chat_template_kwargs).__name__}")
        options = dict(chat_template_kwargs or {})
        encoded = [encode_chat(tokenizer, [dict(m) for m in conv], options) for conv in conversations]
        params = self._params_for(len(encoded), sampling_params)
        requests = [self.engine.make_request(chat.token_ids, sp, text=chat.text)
                    for chat, sp in zip(encoded, params, strict=True)]
        outputs = self._run(requests, use_tqdm)
        for chat, sp, out in zip(encoded, params, outputs, strict=True):
            _apply_reply(chat, sp, out, self.engine.intake.eos_token_ids)
        return outputs

    @staticmethod
    def _params_for(n: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            hint = " (build one with SamplingParams(**...))" if isinstance(sampling_params, Mapping) else ""
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}{hint}")
        params = list(sampling_params)
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        return params

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        wanted = {r.request_id for r in requests}
        done: dict[str, RequestOutput] = {}
        try:
            for req in requests:
                self.engine.add(req)
            with tqdm(total=len(requests), desc="generate", disable=not use_tqdm, unit="req") as bar:
                while len(done) < len(requests):
                    for out in self.engine.step():
                        if out.finished and out.request_id in wanted:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:
            # Interrupted (Ctrl-C lands anywhere, a step raised): this call's unfinished requests are
            # aborted so their blocks come back and the next call starts clean; the exception propagates.
            for req in requests:
                if req.request_id not in done:
                    self.engine.abort(req.request_id)
            raise
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
