"""Teacher forcing: the model's next-token distributions and chosen layers' features over given token
sequences, computed by the engine's own model on its paged cache (``LLM.teacher_force``).

For drafter training (self-distillation: the labels are the target's distributions over its own
replies) and for evaluation. Each sequence is prefilled as one span on freshly allocated blocks, in
batches of at most ``max_tokens`` tokens, with nothing else in flight (the engine must be idle); its
blocks are given back afterwards and never enter the prefix cache. Models with per-request state
slots (DeepSeek-V4) are not supported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.errors import DeepInferError

if TYPE_CHECKING:
    from deepinfer.engine.engine import LLMEngine

_OWNER = "__teacher_force__"  # the block tables' owner names (never a real request id)


@dataclass(frozen=True)
class TeacherForcing:
    """One sequence of ``n`` tokens, teacher-forced: row ``p`` is the model at position ``p`` (it predicts
    token ``p + 1``). ``top_ids``/``top_logits [n, top_k]``: the ``top_k`` largest float32 logits and their
    token ids, descending; ``features [n, H · len(layers)]`` float32: the inputs of the requested layers
    (``capture_hidden``'s ids: ``len(layers)`` is the last layer's output), concatenated in that order
    (``[n, 0]`` when no layer was asked for)."""

    top_ids: torch.Tensor
    top_logits: torch.Tensor
    features: torch.Tensor


def teacher_force(engine: LLMEngine, sequences: Sequence[Sequence[int]], *, top_k: int,
                  layers: Sequence[int] = (), max_tokens: int = 4096,
                  progress: Callable[[int], None] | None = None) -> list[TeacherForcing]:
    """Teacher-force ``sequences`` through ``engine``'s model (module docstring). ``progress(n)`` is called
    with the number of sequences finished after each batch."""
    model, kv = engine.model, engine.kv
    if engine.has_unfinished():
        raise DeepInferError("teacher_force needs an idle engine (requests are in flight)")
    if kv.has_state_slots:
        raise DeepInferError("teacher_force does not support models with per-request state (DeepSeek-V4)")
    vocab = model.vocab_size
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}], got {top_k}")
    for i, seq in enumerate(sequences):
        if not seq or len(seq) > engine.max_model_len:
            raise ValueError(f"sequences[{i}] must have 1 to max_model_len ({engine.max_model_len}) tokens, "
                             f"got {len(seq)}")
        if min(seq) < 0 or max(seq) >= vocab:
            raise ValueError(f"sequences[{i}] has token ids outside [0, {vocab})")
    captured = getattr(model, "captured_layers", ())
    if layers:
        if not callable(getattr(model, "capture_hidden", None)):
            raise DeepInferError(f"{type(model).__name__} cannot capture layer features")
        model.capture_hidden(list(layers))
    results: list[TeacherForcing] = []
    try:
        for batch in _batches(sequences, max_tokens):
            results.extend(_forward(engine, batch, top_k, tuple(layers)))
            if progress is not None:
                progress(len(batch))
    finally:
        if layers:
            model.capture_hidden(list(captured))
    return results


def _batches(sequences: Sequence[Sequence[int]], max_tokens: int) -> list[list[Sequence[int]]]:
    batches: list[list[Sequence[int]]] = [[]]
    used = 0
    for seq in sequences:
        if batches[-1] and used + len(seq) > max_tokens:
            batches.append([])
            used = 0
        batches[-1].append(seq)
        used += len(seq)
    return [b for b in batches if b]


@torch.inference_mode()
def _forward(engine: LLMEngine, batch: list[Sequence[int]], top_k: int,
             layers: tuple[int, ...]) -> list[TeacherForcing]:
    model, kv = engine.model, engine.kv
    owners = [f"{_OWNER}{i}" for i in range(len(batch))]
    try:
        for owner, seq in zip(owners, batch, strict=True):
            if not kv.allocate(owner, len(seq)):
                raise DeepInferError(f"teacher_force: the KV cache cannot hold a batch of {sum(map(len, batch))} "
                                     "tokens; lower max_tokens")
        # Single-token sequences would be read as decode rows, which must come first in a context.
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]) != 1)
        ctx = engine.runner.span_context([(kv.table(owners[i]), 0, len(batch[i])) for i in order])
        ids = torch.tensor([t for i in order for t in batch[i]], dtype=torch.int64, device=ctx.positions.device)
        hidden = model.forward(ids, ctx)
        logits = model.compute_logits(hidden, ctx)
        top_logits, top_ids = logits.topk(top_k, dim=-1)
        if layers:
            features = torch.cat([model.captured_hidden[i] for i in layers], dim=-1).float()
        else:
            features = hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)
        out: dict[int, TeacherForcing] = {}
        start = 0
        for i in order:
            n = len(batch[i])
            out[i] = TeacherForcing(top_ids[start:start + n].cpu(), top_logits[start:start + n].float().cpu(),
                                    features[start:start + n].cpu())
            start += n
        return [out[i] for i in range(len(batch))]
    finally:
        for owner in owners:
            kv.free(owner)
