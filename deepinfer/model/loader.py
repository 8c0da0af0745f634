"""Weight loading: HF folders of safetensors (single, sharded with an index, or several files) and
dummy random weights for benchmarks.

Expert shards: a model whose MoE modules hold only some routed experts (on an expert-parallel rank,
``parallel.placement.ExpertShard``) says so with ``model.expert_ids``, the logical expert of each row
of its sharded expert stacks (the same for every such layer), and ``model.shards_weight(name)``, whether
a checkpoint tensor lies in a sharded layer (e.g. not in an MTP layer, which keeps every expert). The
loader then reads only the held experts' tensors of those layers: a per-expert tensor
(``….experts.{e}.…``, any model) is read only when ``e`` is held, and handed to the model renamed to
the row that holds it (``….experts.{row}.…``, once per row, so replicas get their weights), and the
rows of a fused stack (``….experts.gate_up_proj`` / ``down_proj`` ``[E, …]``) are read in row order.
The model then fills row ``row`` exactly as it would fill expert ``row`` of a full stack.
Dummy weights of such stacks are seeded per (parameter, logical expert), so a shard holds the rows the
full model would. ``skip`` leaves tensors unread altogether (an expert-parallel rank without the ``mtp``
drafter skips the MTP layers', ``model.mtp_weight``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from deepinfer.errors import ModelLoadError, ModelNotFoundError

logger = logging.getLogger(__name__)


# config.json fields the models read as numbers; a present, non-null value of another type is refused here
# with the file named, rather than failing somewhere inside a model's constructor.
_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "max_position_embeddings", "num_nextn_predict_layers", "n_routed_experts",
               "num_experts_per_tok", "moe_intermediate_size", "sliding_window")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def read_json_file(path: Path) -> Any:
    """A JSON file of a model folder; ``ModelLoadError`` naming the file when it is not readable JSON."""
    if path.is_dir():
        raise ModelLoadError(f"{str(path)!r} is a directory, not a JSON file")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{str(path)!r} is not UTF-8 text (a binary file?): byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ModelLoadError(f"{str(path)!r} is nested too deeply to parse") from None
    except OSError as exc:
        raise ModelLoadError(f"{str(path)!r} cannot be read: {exc.strerror or exc}") from None


def read_hf_config(folder: Path) -> dict:
    """``config.json`` of a model folder: a JSON object whose ``architectures`` is a list of names and whose
    common numeric fields are numbers (``ModelLoadError`` naming the file and field otherwise)."""
    path = folder / "config.json"
    if not path.exists():
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no config.json")
    config = read_json_file(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{str(path)!r} must hold a JSON object, got {type(config).__name__}")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelLoadError(f"{str(path)!r}: 'architectures' must be a list of class names, got {archs!r}")
    for key in _INT_FIELDS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ModelLoadError(f"{str(path)!r}: {key!r} must be an integer, got {value!r}")
    for key in _FLOAT_FIELDS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise ModelLoadError(f"{str(path)!r}: {key!r} must be a number, got {value!r}")
    if config.get("model_type") == "deepseek_v41":
        # DeepSeek-V4.1's Engram compresses ids with the folder's own tokenizer.json (deepseek_v4/engram.py).
        config["deepinfer_model_folder"] = str(folder)
        # Its text model's facts sit under text_config; the engine reads the context length at the top.
        text = config.get("text_config")
        if isinstance(text, dict) and "max_position_embeddings" in text:
            config.setdefault("max_position_embeddings", text["max_position_embeddings"])
    return config


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: those the index names, else every ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json_file(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ModelLoadError(f"{str(index)!r} must hold a 'weight_map' object of tensor name → file name")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{str(index)!r} names weight files that are not in the folder: {missing[:3]}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no *.safetensors weights")
    return files


_PER_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"(^|\.)experts\.(gate_up_proj|down_proj)$")


@dataclass
class LoadReport:
    """What a load read from the checkpoint: tensors and their bytes (as stored)."""

    tensors: int = 0
    bytes: int = 0

    def add(self, tensor: torch.Tensor) -> None:
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()


def iter_safetensors(folder: Path, dtype: torch.dtype | None = None, *, expert_ids: Sequence[int] | None = None,
                     shards: Callable[[str], bool] | None = None, skip: Callable[[str], bool] | None = None,
                     report: LoadReport | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder as ``(name, tensor)``, in the checkpoint's own dtype, or cast to
    ``dtype`` when given (integer tensors are never cast), but those ``skip(name)`` accepts, which are
    not read. With ``expert_ids`` (the logical expert of each local row, see the module docstring) only
    those routed experts are read, renamed to their rows, of the tensors ``shards(name)`` accepts (all
    when None). ``report`` counts what was read."""
    for file in safetensors_files(folder):
        # Errors of the file itself (a bad header, a truncated body) name it; the consumer's own exceptions
        # never enter this generator, so only safetensors' and the OS's are translated.
        with _damaged_file(file), safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if skip is not None and skip(name):
                    continue
                sharded = expert_ids is not None and (shards is None or shards(name))
                for out_name, tensor in _read(f, name, expert_ids if sharded else None, report):
                    cast = dtype is not None and tensor.is_floating_point()
                    yield out_name, tensor.to(dtype) if cast else tensor


@contextlib.contextmanager
def _damaged_file(file: Path) -> Iterator[None]:
    """Turn safetensors' and the OS's errors about ``file`` into a ``ModelLoadError`` that names it."""
    try:
        yield
    except SafetensorError as exc:
        raise ModelLoadError(f"{str(file)!r} is not a valid safetensors file (truncated or corrupt?): {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"{str(file)!r} cannot be read: {exc.strerror or exc}") from None


def _read(f: Any, name: str, expert_ids: Sequence[int] | None,
          report: LoadReport | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``name`` gives a model holding ``expert_ids`` (None: all experts): the tensor itself,
    or for a routed expert one renamed copy per row holding it (none, and nothing read, when no row
    does), or a fused stack's held rows. ``report`` counts the reads."""
    match = None if expert_ids is None else _PER_EXPERT.search(name)
    if match is not None:
        expert = int(match.group(2))
        rows = [row for row, e in enumerate(expert_ids) if e == expert]
        if not rows:
            return []
        tensor = f.get_tensor(name)
        out = [(f"{name[:match.start(2)]}{row}{name[match.end(2):]}", tensor) for row in rows]
    elif expert_ids is not None and _FUSED_EXPERTS.search(name) is not None:
        stack = f.get_slice(name)
        tensor = torch.cat([stack[e:e + 1] for e in expert_ids])
        out = [(name, tensor)]
    else:
        tensor = f.get_tensor(name)
        out = [(name, tensor)]
    if report is not None:
        report.add(tensor)
    return out


def load_checkpoint(model: nn.Module, folder: Path, dtype: torch.dtype, *,
                    skip: Callable[[str], bool] | None = None) -> LoadReport:
    """Fill ``model`` from the folder's safetensors but the tensors ``skip`` accepts (not read); every
    parameter must be covered. Returns what was read (only the held experts' tensors when the model has
    ``expert_ids``, see the module docstring).

    Tensors reach ``load_weights`` uncast (the checkpoint's dtype): each model copies them into its
    parameters with ``copy_``, which casts into the parameter's own dtype, so parameters a model keeps
    in float32 whatever ``dtype`` is (DeepSeek's router weight and correction bias) keep the
    checkpoint's full precision. ``dtype`` is the model dtype, kept for the signature's sake."""
    del dtype
    report = LoadReport()
    try:
        loaded = model.load_weights(iter_safetensors(folder, expert_ids=getattr(model, "expert_ids", None),
                                                     shards=getattr(model, "shards_weight", None), skip=skip,
                                                     report=report))
    except ModelLoadError:
        raise
    except ValueError as exc:  # a model's own check: a weight of a wrong shape or name
        raise ModelLoadError(f"the checkpoint in {str(folder)!r} does not match its config.json: {exc}") from None
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint {str(folder)!r} is missing {len(missing)} weights: {shown}")
    return report


def init_dummy(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights on the parameters' own device, seeded by ``seed``: normal(0, std) matrices,
    zero biases, ones for norm scales (the other 1-D parameters). The stacked expert weights
    (``w13``/``w2`` of modules with ``expert_ids``) get each row from its own generator, seeded by
    (``seed``, parameter, logical expert), so an expert shard holds what the full model holds. Integer
    parameters (quantized bytes) are left to their module's ``fill_dummy(seed, std)``."""
    device = next(model.parameters()).device
    stacks = {f"{prefix}.{attr}": module.expert_ids for prefix, module in model.named_modules()
              if hasattr(module, "expert_ids") for attr in ("w13", "w2")}
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name in stacks:
                for row, expert in enumerate(stacks[name]):
                    key = zlib.crc32(f"{seed}:{name}:{expert}".encode())
                    param[row].normal_(0.0, std, generator=torch.Generator(device=device).manual_seed(key))
            elif not param.is_floating_point():
                continue  # stored quantized bytes (FP4 experts): their module's ``fill_dummy`` below
            elif name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
        for module in model.modules():
            if hasattr(module, "fill_dummy"):
                module.fill_dummy(seed, std)
