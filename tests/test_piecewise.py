"""The forward captured in pieces cut at its attention calls (``engine/piecewise.py``), emulated on CPU: a
step replayed through a bucket's static buffers, its attention run on the step's own context over the first
``T`` rows, gives the eager step's tokens and logprobs; padding rows stay out of the router statistics; the
layer features a drafter reads are the step's rows. The captures themselves run on the GPU
(``tests/test_gpu_graphs.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_deepseek import random_prompts, save_tiny_v3
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.engine.piecewise import PiecewiseGraphs, piecewise_buckets

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_buckets_double_up_to_512_then_grow_by_256():
    assert piecewise_buckets(8) == [8]
    assert piecewise_buckets(100) == [8, 16, 32, 64, 100]
    assert piecewise_buckets(2048) == [8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert piecewise_buckets(600) == [8, 16, 32, 64, 128, 256, 512, 600]


def _attach(llm: LLM, max_tokens: int = 64) -> PiecewiseGraphs:
    """Emulated piecewise graphs on ``llm``'s runner: every step that fits them goes through them."""
    engine = llm.engine
    piecewise = PiecewiseGraphs(engine.model, engine.runner.backends, engine.config.cache.block_size,
                                torch.device("cpu"), max_tokens=max_tokens, emulate=True)
    piecewise.capture()
    engine.runner.piecewise = piecewise
    return piecewise


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    out = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [(o.token_ids, [d[t] for t, d in zip(o.token_ids, o.logprobs, strict=True)]) for o in out]


def _assert_same(eager: list, pieces: list) -> None:
    for (ids_e, lp_e), (ids_p, lp_p) in zip(eager, pieces, strict=True):
        assert ids_e == ids_p
        torch.testing.assert_close(torch.tensor(lp_p), torch.tensor(lp_e), atol=1e-5, rtol=0)


def _llm(folder: Path, **overrides: Any) -> LLM:
    return LLM(folder, dtype="float32", kv_cache_bytes=1 << 22, block_size=16, max_num_seqs=4,
               max_num_batched_tokens=64, **overrides)


def test_a_llama_step_through_the_pieces_equals_the_eager_step(tmp_path):
    """Mixed batches (prompt chunks beside decode rows, steps of up to 64 tokens padded to their bucket):
    the same greedy tokens and logprobs as eager steps."""
    save_tiny("llama", tmp_path)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 37, 12, 60, 3, 21)]
    eager = _run(_llm(tmp_path), prompts)
    llm = _llm(tmp_path)  # a new engine: no prefix-cache hits
    piecewise = _attach(llm)
    _assert_same(eager, _run(llm, prompts))
    stats = llm.get_stats()
    assert stats["piecewise_graph_replays"] == piecewise.replays > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_deepseek_v3_pieces_count_only_real_rows_in_the_router_statistics(tmp_path):
    """MLA attention is cut like paged attention; the MoE layers between the cuts see the bucket's padding
    rows, which the router statistics skip: the same counts as eager steps, and the same tokens."""
    save_tiny_v3(tmp_path)
    prompts = random_prompts([7, 30, 11, 19], seed=3)
    counts = []
    for pieces in (False, True):  # a new engine each: no prefix-cache hits
        llm = _llm(tmp_path)
        piecewise = _attach(llm) if pieces else None
        outputs = _run(llm, prompts)
        counts.append((outputs, llm.engine.model.take_router_stats()))
    (eager, eager_stats), (pieces, pieces_stats) = counts
    assert torch.equal(pieces_stats, eager_stats)
    _assert_same(eager, pieces)
    assert piecewise is not None and piecewise.replays > 0


def test_dspark_reads_the_steps_own_features_from_the_pieces(tmp_path):
    """``dspark`` drafts from the target layers' features of each step's rows (``StepResults.hidden``):
    through the pieces every step keeps the eager step's features, row for row, and the tokens are equal."""
    save_tiny("llama", tmp_path)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 25, 14)]
    spec = {"enabled": True, "drafter": "dspark", "dspark_weights": "random", "plan": "fixed", "max_draft": 3}
    runs = []
    for pieces in (False, True):
        llm = _llm(tmp_path, plugins={"spec_decode": spec})
        piecewise = _attach(llm) if pieces else None
        kept: list[torch.Tensor] = []
        runner = llm.engine.runner
        execute = runner.execute

        def keeping(*args: Any, execute=execute, kept=kept, **kwargs: Any) -> Any:
            results = execute(*args, **kwargs)
            kept.append(results.hidden.clone())
            return results

        runner.execute = keeping
        runs.append((_run(llm, prompts), kept, piecewise))
    (eager, eager_kept, _), (outputs, kept, piecewise) = runs
    _assert_same(eager, outputs)
    assert piecewise is not None and piecewise.replays > 0 and piecewise.keeps(runner.hidden_layers)
    assert len(kept) == len(eager_kept)
    for mine, theirs in zip(kept, eager_kept, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
