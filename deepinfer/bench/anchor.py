"""The decode anchor: the decode-throughput method shared with a peer's measurement script, and the peer's
result files read as a baseline (``deepinfer bench --decode-anchor``, ``docs/bench.md``).

The method (the same as ``../shared/tools/vllm/run_vllm.py`` for vLLM): for each batch ``B``, every
timed call is one ``generate`` of ``B`` fresh random prompts of ``prompt_len`` token ids (drawn anew for
every call, so a prefix cache never hits), greedy, EOS ignored, each request checked to return exactly
``max_tokens`` tokens. One repeat times a call with ``max_tokens=1`` (``t1``: prefill + first token) and
one with ``max_tokens = decode_tokens + 1`` (``t_full``); its decode tok/s is ``B · decode_tokens /
(t_full − t1)``. The reported figure is the median over the repeats. One untimed call per batch first.

``length_spread`` (default 0: every prompt ``prompt_len`` tokens, as the peer's script) spreads a call's
prompt lengths evenly over ``prompt_len ± length_spread``, mean exactly ``prompt_len`` (so the mean KV
length, and the byte count of a step, match a peer's one-length prompts). Every call of a batch uses the
same lengths. It matters for ``kernels.force_balanced_routing``, which hashes the position: prompts of
one length decode in lockstep, and every row of a step then draws the same experts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer.bench.workloads import json_lines


def anchor_lengths(batch: int, prompt_len: int, length_spread: int = 0) -> list[int]:
    """The ``batch`` prompt lengths of one call: evenly spaced over ``prompt_len ± length_spread`` (rounded
    half to even, so the list is symmetric about ``prompt_len`` and its mean is exactly ``prompt_len``);
    all ``prompt_len`` when the spread is 0 or the batch is 1."""
    if length_spread < 0 or prompt_len - length_spread < 1:
        raise ValueError(f"length_spread must be in [0, prompt_len - 1], got {length_spread} for prompt_len "
                         f"{prompt_len}")
    if batch == 1 or length_spread == 0:
        return [prompt_len] * batch
    low = prompt_len - length_spread
    return [low + round(2 * length_spread * i / (batch - 1)) for i in range(batch)]


def anchor_prompts(batch: int, seed: int, vocab: int, prompt_len: int, length_spread: int = 0) -> list[list[int]]:
    """``batch`` prompts of random ids in ``[2, vocab)`` (ids 0 and 1 are often BOS/EOS), of
    ``anchor_lengths(batch, prompt_len, length_spread)`` tokens."""
    import torch

    lengths = anchor_lengths(batch, prompt_len, length_spread)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, max(lengths)), generator=gen).tolist()
    return [row[:n] for row, n in zip(ids, lengths, strict=True)]


def run_anchor(llm: Any, batches: Sequence[int], *, repeats: int = 3, prompt_len: int = 128,
               decode_tokens: int = 64, seed: int = 1000, length_spread: int = 0) -> dict[int, dict[str, Any]]:
    """The decode anchor on ``llm`` (a ``deepinfer.LLM``) at each batch: per batch the per-repeat ``t1_s``,
    ``t_full_s`` and ``decode_tok_s`` and their medians (``decode_tok_s_median``, ``prefill_s_median``,
    ``decode_step_ms_median``), and the call's ``prompt_lens``. ``length_spread``: see the module's text."""
    from deepinfer import SamplingParams

    if repeats < 1 or prompt_len < 1 or decode_tokens < 1 or not batches or min(batches) < 1:
        raise ValueError("the decode anchor needs batches >= 1, repeats >= 1, prompt_len >= 1, decode_tokens >= 1")
    anchor_lengths(1, prompt_len, length_spread)  # the spread checked before anything runs
    vocab = llm.engine.intake.vocab_size
    calls = [seed]

    def timed(batch: int, max_tokens: int) -> float:
        calls[0] += 1
        prompts = anchor_prompts(batch, calls[0], vocab, prompt_len, length_spread)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != max_tokens for o in outs):
            raise RuntimeError(f"the decode anchor needs {max_tokens} tokens from every request")
        return elapsed

    results: dict[int, dict[str, Any]] = {}
    for batch in batches:
        timed(batch, decode_tokens + 1)  # warm-up, not measured
        t1s, fulls = [], []
        for _ in range(repeats):
            t1s.append(timed(batch, 1))
            fulls.append(timed(batch, decode_tokens + 1))
        decode = [batch * decode_tokens / (b - a) for a, b in zip(t1s, fulls, strict=True)]
        results[batch] = {"prompt_lens": anchor_lengths(batch, prompt_len, length_spread),
                          "t1_s": t1s, "t_full_s": fulls, "decode_tok_s": decode,
                          "decode_tok_s_median": statistics.median(decode),
                          "prefill_s_median": statistics.median(t1s),
                          "decode_step_ms_median": 1000 * statistics.median(
                              [(b - a) / decode_tokens for a, b in zip(t1s, fulls, strict=True)])}
    return results


def read_peer_anchor(path: str | Path) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """A peer's decode-anchor result file — JSON lines of ``{"B": batch, "decode_tok_s_median": ...}`` and
    one ``{"meta": {...}}`` line, as ``run_vllm.py`` writes — as (batch → row, meta)."""
    rows: dict[int, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--baseline-file {str(path)!r}: {exc.strerror}") from None
    for number, item in json_lines(path, text):
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: expected a {{'B', 'decode_tok_s_median'}} row or a 'meta' line")
        if "meta" in item:
            meta = item["meta"]
        elif "B" in item and "decode_tok_s_median" in item:
            rows[int(item["B"])] = item
        else:
            raise ValueError(f"{path}:{number}: expected a {{'B', 'decode_tok_s_median'}} row or a 'meta' line")
    if not rows:
        raise ValueError(f"{path}: no decode-anchor rows")
    return rows, meta


def anchor_table(ours: dict[int, dict[str, Any]], peer: dict[int, dict[str, Any]] | None = None,
                 peer_name: str = "peer") -> str:
    """A markdown table of our decode tok/s per batch (range over the repeats), with the peer's beside
    them and the ratio where the peer measured that batch."""
    head = "| batch | deepinfer decode tok/s | step ms |"
    rule = "|---|---|---|"
    if peer is not None:
        head += f" {peer_name} decode tok/s | deepinfer / {peer_name} |"
        rule += "---|---|"
    lines = [head, rule]
    for batch, row in sorted(ours.items()):
        runs = row["decode_tok_s"]
        line = (f"| {batch} | {row['decode_tok_s_median']:,.1f} ({min(runs):,.0f}–{max(runs):,.0f}) | "
                f"{row['decode_step_ms_median']:.2f} |")
        if peer is not None:
            theirs = peer.get(batch)
            line += (" - | - |" if theirs is None else
                     f" {theirs['decode_tok_s_median']:,.1f} | "
                     f"{row['decode_tok_s_median'] / theirs['decode_tok_s_median']:.2f}× |")
        lines.append(line)
    return "\n".join(lines)
