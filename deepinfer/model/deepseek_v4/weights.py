"""DeepSeek-V4 checkpoint names and loading.

Weights load under the names transformers saves (``model.layers.L.attn.wq_a.weight``,
``model.layers.L.ffn.experts.E.w1.weight``, ``model.hc_head.hc_fn``, ``head.weight``, …) and the
upstream un-prefixed names (``layers.L.…``, ``embed.weight``, ``hc_head_fn``, ``norm.weight``).
MTP depths (upstream ``mtp.{k}.*``) load into ``V4MTPLayer``s (``mtp.py``). A tensor that is not ours is
an error naming it; hash layers need their ``tid2eid`` tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from deepinfer.model.deepseek_v4.config import V4Dims
from deepinfer.model.deepseek_v4.mtp import V4MTPLayer

if TYPE_CHECKING:
    from deepinfer.model.deepseek_v4 import DeepseekV4ForCausalLM


logger = logging.getLogger(__name__)


# Per-layer names (after ``layers.L.``) → (parameter, narrow) where narrow = (dim-0 offset part, parts).
_ATTN = {
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_weight",
    "attn.wo_b.weight": "self_attn.o_b_weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.indexer.wq_b.weight": "self_attn.indexer.q_b_weight",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate.weight": "mlp.gate_weight",
    "ffn.gate.bias": "mlp.e_score_correction_bias",
}
_COMPRESSOR = {"ape": "position_bias", "norm.weight": "norm.weight"}
_SHARED = {"w1.weight": ("mlp.shared_gate_up", 0), "w3.weight": ("mlp.shared_gate_up", 1),
           "w2.weight": ("mlp.shared_down", None)}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj_weight",
        "h_proj.weight": "h_proj_weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.fn",
        "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"}
_TOP = {"embed.weight": "embed_tokens.weight", "embed_tokens.weight": "embed_tokens.weight",
        "norm.weight": "norm.weight", "hc_head_fn": "hc_head.fn", "hc_head.hc_fn": "hc_head.fn",
        "hc_head_base": "hc_head.base", "hc_head.hc_base": "hc_head.base", "hc_head_scale": "hc_head.scale",
        "hc_head.hc_scale": "hc_head.scale"}


def _half(t: torch.Tensor, part: int) -> torch.Tensor:
    half = t.shape[0] // 2
    return t.narrow(0, part * half, half)




@dataclass(frozen=True)
class Targets:
    """A module's tensors by name, each under ``prefix``: what a checkpoint tensor fills."""

    prefix: str
    tensors: dict[str, torch.Tensor]

    def whole(self, name: str) -> tuple[str, torch.Tensor] | None:
        """``(full name, tensor)`` of ``name``, or None when the module has no such tensor."""
        full = self.prefix + name
        return (full, self.tensors[full]) if full in self.tensors else None

    def view(self, name: str, pick: Callable[[torch.Tensor], torch.Tensor]) -> tuple[str, torch.Tensor] | None:
        """``(full name, pick(tensor))``: a part of ``name`` to fill, or None as ``whole``."""
        found = self.whole(name)
        return None if found is None else (found[0], pick(found[1]))


def layer_target(d: V4Dims, rest: str, prefix: str, tensors: dict[str, torch.Tensor]
                 ) -> tuple[str, torch.Tensor] | None:
    """``(parameter or buffer name, the view to fill)`` for a per-layer checkpoint name ``rest``
    (after ``layers.L.``) of a model with dims ``d``, the module's names starting with ``prefix``; None
    if it is not ours."""
    targets = Targets(prefix, tensors)
    whole, view = targets.whole, targets.view

    if rest in _ATTN:
        return whole(_ATTN[rest])
    if rest == "attn.wq_a.weight":
        return view("self_attn.qkv_a_weight", lambda t: t[: d.q_lora])
    if rest == "attn.wkv.weight":
        return view("self_attn.qkv_a_weight", lambda t: t[d.q_lora:])
    if rest == "ffn.gate.tid2eid":
        return whole("mlp.tid2eid")
    for owner, module in (("attn.indexer.compressor.", "self_attn.indexer.compressor."),
                          ("attn.compressor.", "self_attn.compressor.")):
        if rest.startswith(owner):
            leaf = rest[len(owner):]
            if leaf in ("wkv.weight", "wgate.weight"):
                return view(module + "kv_gate_weight", lambda t, p=int(leaf == "wgate.weight"): _half(t, p))
            return whole(module + _COMPRESSOR[leaf]) if leaf in _COMPRESSOR else None
    if rest.startswith("ffn.shared_experts."):
        leaf = rest[len("ffn.shared_experts."):]
        if leaf not in _SHARED:
            return None
        name, part = _SHARED[leaf]
        return whole(name) if part is None else view(name, lambda t: _half(t, part))
    if rest.startswith("ffn.experts."):
        _, _, e, leaf = rest.split(".", 3)
        if leaf == "w2.weight":
            return view("mlp.w2", lambda t: t[int(e)])
        if leaf in ("w1.weight", "w3.weight"):
            return view("mlp.w13", lambda t: _half(t[int(e)], int(leaf == "w3.weight")))
        return None
    for site in ("attn", "ffn"):
        for leaf in ("fn", "base", "scale"):
            if rest == f"hc_{site}_{leaf}":
                return whole(f"{site}_hc.{leaf}")
    return None

def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (its data) and buffer of ``module`` by name."""
    return {**{n: p.data for n, p in module.named_parameters()}, **dict(module.named_buffers())}

def load_checkpoint(model: DeepseekV4ForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Fill ``model``'s parameters from transformers' saved names or the upstream names; returns those filled."""
    tensors = module_tensors(model)
    filled: dict[str, int] = {}
    mtp_tensors: list[tuple[str, torch.Tensor]] = []
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        if name.startswith("mtp."):
            mtp_tensors.append((name, tensor))
            continue
        if name in ("head.weight", "lm_head.weight"):
            if model.lm_head is None:
                continue
            dest: tuple[str, torch.Tensor] | None = ("lm_head", model.lm_head.data)
        elif name in _TOP:
            dest = (_TOP[name], tensors[_TOP[name]])
        elif name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            if int(idx) >= model.d.layers:
                logger.info("%s: skipping %s (past num_hidden_layers)", model.architecture, name)
                continue
            dest = layer_target(model.d, rest, f"layers.{idx}.", tensors)
        else:
            dest = None
        if dest is None:
            raise ValueError(f"weight {name!r} does not belong to {model.architecture}")
        _copy(name, dest, tensor, filled)
    tables = [f"layers.{i}.mlp.tid2eid" for i, t in enumerate(model.d.mlp_types) if t == "hash_moe"]
    missing_tables = [t for t in tables if t not in filled]
    if missing_tables:
        raise ValueError(f"checkpoint has no ffn.gate.tid2eid for {', '.join(missing_tables)}")
    params = dict(model.named_parameters())
    loaded = {n for n, count in filled.items() if n in params and count >= params[n].numel()}
    if mtp_tensors:
        loaded |= load_mtp(model, mtp_tensors)
    return loaded

def load_mtp(model: DeepseekV4ForCausalLM, tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
    """Build ``model.mtp_layers`` from upstream ``mtp.{k}.*`` tensors; a depth with tensors that do not fit,
    or with parameters left unfilled, is dropped with a warning."""
    d = model.d
    by_depth: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors:
        _, k, rest = name.split(".", 2)
        by_depth.setdefault(int(k), []).append((rest, tensor))
    loaded: set[str] = set()
    for k in sorted(by_depth):
        if k != len(model.mtp_layers):
            logger.warning("%s: MTP depth %d skipped (depths must be consecutive from 0)", model.architecture, k)
            continue
        layer = V4MTPLayer(d, model.rotary_main, model._dtype, model._device)
        targets = module_tensors(layer)
        filled: dict[str, int] = {}
        problem = None
        for rest, tensor in by_depth[k]:
            if rest in ("emb.tok_emb.weight", "head.weight", "embed.weight"):
                continue  # copies of the main model's embedding / head
            dest = ((_MTP[rest], targets[_MTP[rest]]) if rest in _MTP
                    else layer_target(d, rest, "block.", targets))
            if dest is None or dest[1].shape != tensor.shape:
                problem = rest
                break
            _copy(rest, dest, tensor, filled)
        params = dict(layer.named_parameters())
        missing = [n for n, p in params.items() if filled.get(n, 0) < p.numel()]
        if problem or missing:
            why = (f"unexpected tensor {problem!r}" if problem
                   else f"{len(missing)} tensors missing, e.g. {missing[0]}")
            logger.warning("%s: MTP depth %d not loaded (%s)", model.architecture, k, why)
            continue
        model.mtp_layers.append(layer)
        loaded |= {f"mtp_layers.{k}.{n}" for n in params}
    return loaded



def _copy(name: str, dest: tuple[str, torch.Tensor], tensor: torch.Tensor, filled: dict[str, int]) -> None:
    """Copy a checkpoint tensor into its destination view and count the elements filled per parameter."""
    owner, target = dest
    if target.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)
    filled[owner] = filled.get(owner, 0) + target.numel()
