"""DeepSeek-V4.1 checkpoint names (the reference's ``hugging_face/names.py``) and loading.

V4's upstream names with ``attn.kv_norm`` (V4: ``attn.norm``), ``attn.indexer.{wk,k_norm}``, no compressor
``ape``, and ``engram.{q_weight,k_weight,wkv.weight,embed.weight}`` (the table memory-mapped, never a
parameter); a missing or extra tensor is an error naming it. DSpark layers (``mtp.{i}.*``) are skipped with
a warning (the ``dspark`` drafter needs the DSpark issue's ring context); image tensors
(``vision_pipeline.*``, ``image_*``, ``ffn.gate.bias_vl``) belong to the vision side this text model does
not run, and are skipped with an info line. With ``quantization_config.expert_dtype: fp4`` each routed
expert is ``ffn.experts.{e}.w{1,2,3}.weight`` (packed e2m1, ``I8 [out, in/2]``) with ``.scale`` (``F8_E8M0
[out, in/32]``), copied byte for byte into ``fp4_moe.V4Fp4MoE``'s stored tensors; a scale whose shape does
not match its weight's is an error naming it. With ``quant_method: fp8`` a dense weight may be e4m3 with
``X.scale`` ue8m0 per 32×32 block: dequantized to the model dtype at load (``_dense_fp8``; the dense weights
are then held in bf16/fp32, only the routed experts stay quantized).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer.model.deepseek_v4.engram import mmap_safetensor
from deepinfer.model.deepseek_v4.v41_config import ARCH, V41Dims
from deepinfer.model.deepseek_v4.weights import Targets, _copy, _half, module_tensors
from deepinfer.model.layers.fp4 import ue8m0_values

if TYPE_CHECKING:
    from deepinfer.model.deepseek_v4.v41 import DeepseekV41ForCausalLM

logger = logging.getLogger(__name__)


_V41_ATTN = {
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_weight",
    "attn.wo_b.weight": "self_attn.o_b_weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.norm.weight": "self_attn.compressor.norm.weight",
    "attn.indexer.wk.weight": "self_attn.index_keys.wk_weight",
    "attn.indexer.k_norm.weight": "self_attn.index_keys.k_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.index_query.q_b_weight",
    "attn.indexer.weights_proj.weight": "self_attn.index_query.weights_weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate.weight": "mlp.gate_weight",
    "ffn.gate.bias": "mlp.e_score_correction_bias",
    **{f"hc_{site}_{leaf}": f"{site}_hc.{leaf}" for site in ("attn", "ffn") for leaf in ("fn", "base", "scale")},
}
_V41_TOP = {"embed.weight": "embed_tokens.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.fn",
            "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"}
_VISION_ONLY = ("vision_pipeline.", "image_start", "image_end", "image_newline")


_FP4_PARTS = ("mlp.w13_fp4", "mlp.w2_fp4", "mlp.w13_scale", "mlp.w2_scale")


def fp4_stored_bytes(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An FP4 expert tensor's bytes as uint8, unchanged: ``X.weight`` packed e2m1 (``I8``/``U8``),
    ``X.scale`` ue8m0 (``F8_E8M0``, or ``U8``). Any other dtype is an error naming the tensor."""
    allowed = ((torch.int8, torch.uint8) if name.endswith(".weight")
               else (torch.float8_e8m0fnu, torch.uint8))
    if tensor.dtype not in allowed:
        raise ValueError(f"weight {name!r} has dtype {tensor.dtype}; expert_dtype fp4 stores it as "
                         f"{' or '.join(map(str, allowed))}")
    return tensor.view(torch.uint8)


FP8_BLOCK = 32  # quantization_config.weight_block_size [32, 32]


def dequantize_fp8_blocks(name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A dense FP8 checkpoint weight (``quant_method: fp8``): e4m3 ``[out, in]`` with ue8m0 scales
    ``[ceil(out/32), ceil(in/32)]``, one per 32×32 block → float32 (exact: a power-of-two scale). A scale of
    another shape or dtype is an error naming it."""
    want = tuple(-(-n // FP8_BLOCK) for n in weight.shape)
    if weight.dim() != 2 or tuple(scale.shape) != want or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"weight {name.removesuffix('.weight') + '.scale'!r} has shape {tuple(scale.shape)} "
                         f"({scale.dtype}); the FP8 weight {name!r} of shape {tuple(weight.shape)} needs ue8m0 "
                         f"scales of shape {want}, one per {FP8_BLOCK}x{FP8_BLOCK} block")
    rows, cols = weight.shape
    s = ue8m0_values(scale).repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * s


def _dense_fp8(weights: Iterable[tuple[str, torch.Tensor]], allowed: bool, fp4_experts: bool
               ) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` with every dense FP8 tensor (``float8_e4m3fn``) replaced by its float32 dequantization,
    paired with its ``X.scale`` in whichever order they arrive; routed FP4 experts (``fp4_experts``) pass
    through (``fp4_stored_bytes`` checks them). An
    FP8 weight without its scale, a scale without its weight, or FP8 weights without ``quant_method: fp8``
    (``allowed``) are errors naming the tensor."""
    scales: dict[str, torch.Tensor] = {}
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if fp4_experts and ".ffn.experts." in name:
            yield name, tensor
            continue
        if name.endswith(".scale"):
            base = name.removesuffix(".scale") + ".weight"
            if base in waiting:
                yield base, dequantize_fp8_blocks(base, waiting.pop(base), tensor)
            else:
                scales[base] = tensor
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            if not allowed:
                raise ValueError(f"weight {name!r} is FP8 but config.json has no quantization_config.quant_method fp8")
            if name in scales:
                yield name, dequantize_fp8_blocks(name, tensor, scales.pop(name))
            else:
                waiting[name] = tensor
            continue
        yield name, tensor
    if waiting:
        raise ValueError(f"weight {next(iter(waiting))!r} is FP8 and the checkpoint has no "
                         f"{next(iter(waiting)).removesuffix('.weight') + '.scale'!r}")
    if scales:
        raise ValueError(f"weight {next(iter(scales)).removesuffix('.weight') + '.scale'!r} scales no FP8 weight")


def v41_layer_target(d: V41Dims, rest: str, prefix: str, tensors: dict[str, torch.Tensor]
                     ) -> tuple[str, torch.Tensor] | None:
    """``(parameter name, the view to fill)`` for a V4.1 per-layer name ``rest`` (after ``layers.L.``);
    None if the layer has no such tensor."""
    targets = Targets(prefix, tensors)
    whole, view = targets.whole, targets.view

    if rest in _V41_ATTN:
        return whole(_V41_ATTN[rest])
    if rest == "attn.wq_a.weight":
        return view("self_attn.qkv_a_weight", lambda t: t[: d.q_lora])
    if rest == "attn.wkv.weight":
        return view("self_attn.qkv_a_weight", lambda t: t[d.q_lora:])
    if rest in ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"):
        found = whole("self_attn.compressor.kv_gate_weight")
        if found is None:
            return None
        if found[1].shape[0] == 2 * d.head_dim:  # gated (C2): [wkv; wgate]
            return found[0], _half(found[1], int(rest.endswith("wgate.weight")))
        return found if rest.endswith("wkv.weight") else None  # C1 has no gate
    if rest in ("engram.q_weight", "engram.k_weight", "engram.wkv.weight"):
        return whole({"engram.q_weight": "engram.q_weight", "engram.k_weight": "engram.k_weight",
                      "engram.wkv.weight": "engram.wkv_weight"}[rest])
    if rest.startswith("ffn.shared_experts."):
        leaf = rest[len("ffn.shared_experts."):]
        if leaf == "w2.weight":
            return whole("mlp.shared_down")
        if leaf in ("w1.weight", "w3.weight"):
            return view("mlp.shared_gate_up", lambda t: _half(t, int(leaf == "w3.weight")))
        return None
    if rest.startswith("ffn.experts.") and d.expert_dtype == "fp4":
        _, _, e, leaf = rest.split(".", 3)
        which, _, kind = leaf.partition(".")
        if which not in ("w1", "w2", "w3") or kind not in ("weight", "scale"):
            return None
        param = {"weight": "fp4", "scale": "scale"}[kind]
        if which == "w2":
            return view(f"mlp.w2_{param}", lambda t: t[int(e)])
        return view(f"mlp.w13_{param}", lambda t: _half(t[int(e)], int(which == "w3")))
    if rest.startswith("ffn.experts."):
        _, _, e, leaf = rest.split(".", 3)
        if leaf == "w2.weight":
            return view("mlp.w2", lambda t: t[int(e)])
        if leaf in ("w1.weight", "w3.weight"):
            return view("mlp.w13", lambda t: _half(t[int(e)], int(leaf == "w3.weight")))
    return None


def load_v41_checkpoint(model: DeepseekV41ForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Fill ``model``'s parameters from the reference's tensor names (module docstring); a tensor that is
    not ours, or a parameter left unfilled, is an error naming it. Returns the parameters filled."""
    tensors = module_tensors(model)
    filled: dict[str, int] = {}
    skipped_mtp = skipped_vision = 0
    folder = None if model.d.engram is None or model.d.engram.folder is None else Path(model.d.engram.folder)
    for stored_name, tensor in _dense_fp8(weights, model.d.quant_method == "fp8",
                                                  model.d.expert_dtype == "fp4"):
        name = stored_name.removeprefix("model.")
        if name.startswith("mtp."):
            skipped_mtp += 1
            continue
        if name.startswith(_VISION_ONLY) or name.endswith("ffn.gate.bias_vl"):
            skipped_vision += 1
            continue
        dest: tuple[str, torch.Tensor] | None = None
        if name == "head.weight":
            if model.lm_head is None:
                raise ValueError(f"weight {name!r}: config.json has tie_word_embeddings=true")
            dest = ("lm_head", model.lm_head.data)
        elif name in _V41_TOP and _V41_TOP[name] in tensors:
            dest = (_V41_TOP[name], tensors[_V41_TOP[name]])
        elif name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            engram = model.layers[int(idx)].engram if int(idx) < model.d.layers else None
            if rest == "engram.embed.weight" and engram is not None:
                mapped = None if folder is None else mmap_safetensor(folder, stored_name)
                engram.set_table(tensor if mapped is None else mapped)  # host memory, never a parameter
                continue
            if int(idx) < model.d.layers:
                dest = v41_layer_target(model.d, rest, f"layers.{idx}.", tensors)
        if dest is None:
            raise ValueError(f"weight {name!r} does not belong to {ARCH}")
        if dest[0].endswith(_FP4_PARTS):
            tensor = fp4_stored_bytes(name, tensor)
        _copy(name, dest, tensor, filled)
    if skipped_mtp:
        logger.warning("%s: %d DSpark tensors (mtp.*) not loaded: DSpark heads are not supported yet", ARCH,
                       skipped_mtp)
    if skipped_vision:
        logger.info("%s: %d vision tensors skipped (text-only model)", ARCH, skipped_vision)
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if filled.get(n, 0) < p.numel()]
    missing += [f"layers.{layer.layer}.engram.embed.weight" for layer in model.layers
                if layer.engram is not None and layer.engram.table is None]
    if missing:
        raise ValueError(f"checkpoint has no tensor for {ARCH} parameter {missing[0]!r}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    return set(params)
