"""Convert a llama.cpp GGUF checkpoint into a plain Hugging Face folder.

The result is an ordinary fp32 `LlamaForCausalLM` or `Gemma3ForCausalLM` folder (config.json,
model.safetensors, tokenizer.json, ...), so the rest of deepinfer only ever loads one format. This
needs numpy, gguf, safetensors and tokenizers; it does not import transformers or torch.

Four things about GGUF files matter here:

* Tensor shapes are stored innermost-first (`[in, out]`); the reader hands the data back row-major as
  `(out, in)`, still quantized, and `gguf.quants.dequantize` expands it to float32 values.
* llama.cpp's converter reorders the rows of the Q and K projections, per head, from Hugging Face's
  "rotate halves" rope layout into the interleaved-pairs layout that its own rope kernel expects.
  `llama.undo_rope_permutation` puts them back. Gemma uses rotate-halves rope in llama.cpp too, so its
  rows are left alone.
* llama.cpp's converter stores Gemma's RMSNorm weights as ``1 + w`` (its norm kernel multiplies by
  the weight), while Hugging Face's Gemma keeps ``w`` and multiplies by ``1 + w``; the conversion
  subtracts 1 again, exactly as transformers' own GGUF loader does.
* The tokenizer is stored as metadata (tokens, merges or scores, token types, a pre-tokenizer
  *name*), not as a tokenizer.json; `tokenizer.build_tokenizer` rebuilds one with the `tokenizers` library. The
  split rules for each pre-tokenizer name follow llama.cpp's `llama-vocab.cpp`, which is what the file
  was made for.

By job: ``metadata.py`` (reading the file's key/values), ``weights.py`` (tensor names, loading and checks
shared by the architectures), ``llama.py`` and ``gemma3.py`` (one architecture each), ``tokenizer.py``
with ``byte_bpe.py`` and ``sentencepiece.py`` (the two tokenizer rebuilders); this module writes the folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from safetensors.numpy import save_file

from deepinfer.errors import ConfigError
from deepinfer.model.gguf_convert.gemma3 import GEMMA3
from deepinfer.model.gguf_convert.llama import LLAMA
from deepinfer.model.gguf_convert.metadata import read_gguf_metadata
from deepinfer.model.gguf_convert.tokenizer import build_tokenizer, generation_config, tokenizer_config
from deepinfer.model.gguf_convert.weights import check_tensors, load_tensors

logger = logging.getLogger(__name__)

__all__ = ["build_tokenizer", "convert_gguf_to_hf", "read_gguf_metadata"]

# `general.architecture` -> how it maps onto a Hugging Face model.
ARCHITECTURES = {"llama": LLAMA, "gemma3": GEMMA3}


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _finish_tree(folder: Path) -> None:
    """Make the staged files world-readable (mkdtemp and safetensors create them private) and durable."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a Llama or Gemma-3 GGUF file into an fp32 Hugging Face folder at `out_dir`.

    The folder holds config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and (when the GGUF has one) chat_template.jinja. It is written into a
    sibling temporary folder and renamed into place, so a crash never leaves a half-written
    `out_dir`. `out_dir` must not exist, or be an empty folder. Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"conversion target {out_dir} already exists and is not an empty folder")
    started = time.perf_counter()
    reader = GGUFReader(gguf_path)
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported (only {', '.join(sorted(ARCHITECTURES))})"
        )
    layout = ARCHITECTURES[arch]

    names = {tensor.name for tensor in reader.tensors}
    tied = "output.weight" not in names
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ConfigError(f"{gguf_path}: GGUF has no token_embd.weight tensor")
    vocab_size = int(embed.shape[-1])
    declared = meta.get(f"{arch}.vocab_size")
    if declared is not None and int(declared) != vocab_size:
        raise ConfigError(f"{gguf_path}: {arch}.vocab_size={declared} but token_embd has {vocab_size} rows")

    config = layout.build_config(meta, arch, vocab_size, tied)
    tensors = load_tensors(reader, config, layout)
    check_tensors(tensors, config, layout)
    tokenizer = build_tokenizer(meta)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", generation_config(meta, config))
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config(meta, config))
        template = meta.get("tokenizer.chat_template")
        if template:
            (staging / "chat_template.jinja").write_text(template, encoding="utf-8")
        _finish_tree(staging)
        if out_dir.is_dir():
            out_dir.rmdir()  # empty, checked above; rename() cannot replace it otherwise
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - started
    logger.info("converted %s -> %s (%d tensors, %.1fs)", gguf_path, out_dir, len(tensors), elapsed)
    return out_dir
