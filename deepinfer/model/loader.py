"""Weight loading: HF folders of safetensors (single, sharded with an index, or several files) and
dummy random weights for benchmarks."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from deepinfer.errors import ModelNotFoundError

logger = logging.getLogger(__name__)


def read_hf_config(folder: Path) -> dict:
    """``config.json`` of a model folder."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no config.json")
    return json.loads(path.read_text())


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: those the index names, else every ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no *.safetensors weights")
    return files


def iter_safetensors(folder: Path, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder as ``(name, tensor)``, in the checkpoint's own dtype, or cast to
    ``dtype`` when given (integer tensors are never cast)."""
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                cast = dtype is not None and tensor.is_floating_point()
                yield name, tensor.to(dtype) if cast else tensor


def load_checkpoint(model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """Fill ``model`` from the folder's safetensors; every parameter must be covered.

    Tensors reach ``load_weights`` uncast (the checkpoint's dtype): each model copies them into its
    parameters with ``copy_``, which casts into the parameter's own dtype, so parameters a model keeps
    in float32 whatever ``dtype`` is (DeepSeek's router weight and correction bias) keep the
    checkpoint's full precision. ``dtype`` is the model dtype, kept for the signature's sake."""
    del dtype
    loaded = model.load_weights(iter_safetensors(folder))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {str(folder)!r} is missing {len(missing)} weights: {shown}")


def init_dummy(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights on the parameters' own device, seeded by ``seed``: normal(0, std) matrices,
    zero biases, ones for norm scales (the other 1-D parameters)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
