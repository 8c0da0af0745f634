"""Benchmark workloads: what is asked (prompts and output lengths), independent of who answers.

Every workload is a list of ``BenchRequest``; ``materialize`` turns text and chat prompts into token
ids with the model's tokenizer, so the engine and the transformers baseline see identical ids.

- ``random``: random token ids, input/output lengths uniform in ``L·(1 ± range_ratio)``;
- ``shared-prefix``: ``num_prefixes`` groups whose requests share a prefix of ``prefix_len`` tokens
  followed by a random suffix (prefix-cache workloads);
- ``repeat``: prompts made of a short random pattern repeated to the input length (repetition-heavy,
  for n-gram / speculative decoding);
- ``FILE.jsonl``: one request a line, ``{"prompt": "..."}``, ``{"prompt_token_ids": [...]}`` or
  ``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered with the chat template), each with
  an optional ``"output_len"`` (or ``"max_tokens"``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASETS = ("random", "shared-prefix", "repeat")


@dataclass
class BenchRequest:
    """One request of a workload. Exactly one of ``prompt_token_ids``, ``prompt`` and ``messages``."""

    output_len: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None


@dataclass
class WorkloadSpec:
    """The workload flags of ``deepinfer bench`` / ``deepinfer ab``."""

    dataset: str = "random"
    num_prompts: int = 32
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int | None = None  # shared-prefix: tokens shared per group (default 3/4 of input_len)
    num_prefixes: int = 4
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo = max(1, round(mean * (1 - ratio)))
    hi = max(lo, round(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def token_range(vocab_size: int) -> tuple[int, int]:
    """Token ids drawn for synthetic prompts: skip the lowest ids (special tokens in most vocabularies)
    and stay below 40000 (ordinary text tokens in the SmolLM2/Llama vocabularies)."""
    lo = min(200, vocab_size // 8)
    return lo, min(vocab_size, 40000)


def random_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    lo, hi = token_range(vocab_size)
    out = []
    for _ in range(spec.num_prompts):
        n_in = _length(rng, spec.input_len, spec.range_ratio)
        n_out = _length(rng, spec.output_len, spec.range_ratio)
        out.append(BenchRequest(n_out, [rng.randrange(lo, hi) for _ in range(n_in)]))
    return out


def shared_prefix_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    lo, hi = token_range(vocab_size)
    prefix_len = spec.prefix_len if spec.prefix_len is not None else (3 * spec.input_len) // 4
    groups = max(1, spec.num_prefixes)
    prefixes = [[rng.randrange(lo, hi) for _ in range(prefix_len)] for _ in range(groups)]
    out = []
    for i in range(spec.num_prompts):
        n_suffix = max(1, _length(rng, spec.input_len, spec.range_ratio) - prefix_len)
        suffix = [rng.randrange(lo, hi) for _ in range(n_suffix)]
        out.append(BenchRequest(_length(rng, spec.output_len, spec.range_ratio), prefixes[i % groups] + suffix))
    return out


def repeat_workload(spec: WorkloadSpec, vocab_size: int, pattern_len: int = 8) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    lo, hi = token_range(vocab_size)
    out = []
    for _ in range(spec.num_prompts):
        n_in = _length(rng, spec.input_len, spec.range_ratio)
        pattern = [rng.randrange(lo, hi) for _ in range(rng.randint(2, pattern_len))]
        ids = (pattern * (n_in // len(pattern) + 1))[:n_in]
        out.append(BenchRequest(_length(rng, spec.output_len, spec.range_ratio), ids))
    return out


def json_lines(path: str | Path, text: str) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank JSON line of ``text`` (read from ``path``); a line that is
    not JSON is a ``ValueError`` naming ``path:line``."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from None


def file_workload(spec: WorkloadSpec, path: str | Path) -> list[BenchRequest]:
    """Read a JSONL file; ``num_prompts`` takes the first N lines (cycling when the file is shorter)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--dataset {str(file)!r}: no such file (or use one of {', '.join(DATASETS)})")
    rows: list[BenchRequest] = []
    for lineno, item in json_lines(file, file.read_text()):
        if not isinstance(item, dict):
            raise ValueError(f"{file}:{lineno}: expected an object with prompt, prompt_token_ids or messages")
        out_len = int(item.get("output_len", item.get("max_tokens", spec.output_len)))
        if "prompt_token_ids" in item:
            rows.append(BenchRequest(out_len, prompt_token_ids=[int(t) for t in item["prompt_token_ids"]]))
        elif "messages" in item:
            rows.append(BenchRequest(out_len, messages=list(item["messages"])))
        elif "prompt" in item:
            rows.append(BenchRequest(out_len, prompt=str(item["prompt"])))
        else:
            raise ValueError(f"{file}:{lineno}: expected one of prompt, prompt_token_ids, messages")
    if not rows:
        raise ValueError(f"--dataset {str(file)!r}: the file has no requests")
    n = spec.num_prompts or len(rows)
    return [rows[i % len(rows)] for i in range(n)]


def build_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    if spec.num_prompts < 1 and spec.dataset in DATASETS:
        raise ValueError("--num-prompts must be at least 1")
    if spec.input_len < 1 or spec.output_len < 1:
        raise ValueError("--input-len and --output-len must be at least 1")
    if not 0 <= spec.range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    if spec.dataset == "random":
        return random_workload(spec, vocab_size)
    if spec.dataset == "shared-prefix":
        return shared_prefix_workload(spec, vocab_size)
    if spec.dataset == "repeat":
        return repeat_workload(spec, vocab_size)
    return file_workload(spec, spec.dataset)


def materialize(requests: list[BenchRequest], tokenizer: Any) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request; text and chat need the model's tokenizer."""
    out = []
    for r in requests:
        if r.prompt_token_ids is not None:
            ids = list(r.prompt_token_ids)
        else:
            if tokenizer is None:
                raise ValueError("the workload has text or chat prompts but the model has no tokenizer.json")
            text = r.prompt if r.prompt is not None else tokenizer.render_chat([dict(m) for m in r.messages or []])
            ids = tokenizer.encode(text)
        if not ids:
            raise ValueError("a workload prompt is empty after tokenization")
        out.append((ids, r.output_len))
    return out


def warmup_workload(vocab_size: int, n: int = 2, input_len: int = 16, output_len: int = 4
                    ) -> list[tuple[list[int], int]]:
    """A few short requests with their own seed (so they share no prefix with the measured workload)."""
    reqs = random_workload(WorkloadSpec(num_prompts=n, input_len=input_len, output_len=output_len,
                                        seed=0x5EED_0BAD), vocab_size)
    return [(r.prompt_token_ids or [], r.output_len) for r in reqs]


def describe(spec: WorkloadSpec, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """The ``workload`` object of the bench/ab JSON."""
    ins = [len(p) for p, _ in work]
    outs = [m for _, m in work]
    return {
        "dataset": spec.dataset,
        "num_prompts": len(work),
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "range_ratio": spec.range_ratio,
        "prefix_len": spec.prefix_len,
        "num_prefixes": spec.num_prefixes,
        "seed": spec.seed,
        "total_input_tokens": sum(ins),
        "total_output_tokens": sum(outs),
        "input_len_min": min(ins),
        "input_len_max": max(ins),
        "output_len_min": min(outs),
        "output_len_max": max(outs),
    }
