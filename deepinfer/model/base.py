"""What the core expects of a model class (the registry's values follow this protocol)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from deepinfer.interfaces import ForwardContext
from deepinfer.kv.specs import CacheSpec


class CausalLM(Protocol):
    """A causal LM built as ``cls(hf_config, *, dtype, device, max_positions)``.

    ``forward`` maps ``input_ids [T]`` (all requests' new tokens, flattened) to hidden states
    ``[T, hidden]``; ``compute_logits`` maps selected hidden rows to float32 logits ``[N, vocab]``.
    ``bind_cache`` hands each layer its cache tensors (one tuple per spec of ``cache_specs()``).
    ``load_weights`` takes ``(name, tensor)`` pairs as HF saves them, in the checkpoint's dtype (copy
    them in with ``param.copy_``, which casts into the parameter's own dtype), and returns the names
    of the parameters it filled. ``gemm_weights`` lists the parameters used as ``linear`` weights, so the
    GEMM backend can lay them out once after loading (``GemmBackend.prepare_weight``).
    """

    vocab_size: int

    def cache_specs(self) -> Sequence[CacheSpec]: ...
    def bind_cache(self, caches: Sequence[tuple[torch.Tensor, ...]]) -> None: ...
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...
    def gemm_weights(self) -> list[torch.nn.Parameter]: ...
    def named_parameters(self) -> Any: ...


class StackedDecoderLM(torch.nn.Module):
    """What the decoder-only models share: ``forward`` runs ``embed_tokens`` → every layer of
    ``layers`` (called as ``layer(positions, x, ctx)``) → ``norm``, and ``compute_logits`` applies the
    LM head (``lm_head``, or the tied ``embed_tokens`` weight when it is None) through the ``linear``
    op, in float32. Subclasses set those four attributes; a model with another residual shape
    overrides ``forward`` (calling ``run_layers`` when its layers take that call).

    ``capture_hidden(layer_ids)`` is for drafters that read the main model's features (``dspark``):
    every later ``forward`` keeps the residual stream entering each chosen layer (id
    ``len(layers)``: the last layer's output, before ``norm``) in ``captured_hidden``."""

    embed_tokens: torch.nn.Embedding
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    lm_head: torch.nn.Parameter | None
    captured_layers: tuple[int, ...] = ()

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        """Keep, from the next ``forward`` on, the input ``[T, hidden]`` of each layer in ``layer_ids``
        (ids in ``[0, len(layers)]``) in ``captured_hidden`` (layer id → tensor, replaced per forward)."""
        bad = [i for i in layer_ids if not 0 <= i <= len(self.layers)]
        if bad:
            raise ValueError(f"capture_hidden: layer ids {bad} are outside [0, {len(self.layers)}]")
        self.captured_layers = tuple(layer_ids)
        self.captured_hidden: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.norm(self.run_layers(self.embed_tokens(input_ids), ctx))

    def run_layers(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Every layer of ``layers`` over the embedded input ``x [T, hidden]``, keeping the captured
        layers' inputs (``capture_hidden``); a subclass overriding ``forward`` calls it too."""
        for i, layer in enumerate(self.layers):
            if i in self.captured_layers:
                self.captured_hidden[i] = x
            x = layer(ctx.positions, x, ctx)
        if len(self.layers) in self.captured_layers:
            self.captured_hidden[len(self.layers)] = x
        return x

    def compute_logits(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return ctx.backends["linear"].linear(hidden, weight).float()


def config_value(hf_config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present in ``hf_config`` (configs rename fields across versions)."""
    for name in names:
        if hf_config.get(name) is not None:
            return hf_config[name]
    return default
