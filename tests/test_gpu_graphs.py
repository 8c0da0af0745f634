"""CUDA graphs and on-device sampling on the GPU (run on the lent H200: ``pytest -m gpu``).

- Graph replay gives the same tokens and logprobs as eager execution for every bucket, on a tiny
  Llama (Triton paged attention) and a tiny DeepSeek-V3 (Triton MLA and MoE), in fp32 so the
  comparison is tight; also under speculative decoding and the overlapped executor.
- DeepSeek-V4 (per-request state slots) decode steps replay graphs too, equal to eager, and so do its
  verification steps under speculative decoding (``oracle`` and ``mtp`` drafters); so do ``dspark``'s,
  whose target layers' features the graphs keep, and its drafting replays graphs of its own equal to eager;
  and its whole speculative tail replays one graph per step (``engine/tail_graphs.py``), equal to eager.
- Steps with prompt rows replay the forward captured in pieces (``engine/piecewise.py``), equal to eager.
- The router statistics of replayed steps count the step's tokens, not the bucket's padding rows.
- Sampling and verification on the device draw from the target distribution (chi-square against the
  exact distribution computed on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_sampling import _chi_square_p, _expected
from tiny_deepseek import save_tiny_v3
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.sampling.sampler import SamplingBatch, sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PLUGINS = {"attention": {"enabled": True}, "moe": {"enabled": True}}
MAX_SEQS = 24  # buckets 1, 2, 4, 8, 16, 24
BATCHES = (1, 2, 3, 5, 9, 17, 24)  # at least one batch per bucket


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        save_tiny("llama", path)
        return path
    return save_tiny_v3(path)


def _llm(folder: Path, graphs: bool, **overrides: Any) -> LLM:
    return LLM(folder, device="cuda", dtype="float32", kv_cache_bytes=1 << 26, block_size=16,
               max_num_seqs=MAX_SEQS, plugins={**PLUGINS, **overrides.pop("plugins", {})},
               kernels={"cuda_graphs": graphs, **overrides.pop("kernels", {})}, **overrides)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 200, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _run(llm: LLM, prompts: list[list[int]], **params: Any) -> list[tuple[list[int], list[float]]]:
    """(tokens, their logprobs) per prompt; no logprobs (``logprobs=None``): an empty list."""
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": 0, **params})
    out = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    return [(o.token_ids, [d[t] for t, d in zip(o.token_ids, o.logprobs, strict=True)] if o.logprobs else [])
            for o in out]


def _compare(eager: list, graphed: list) -> None:
    for (ids_e, lp_e), (ids_g, lp_g) in zip(eager, graphed, strict=True):
        assert ids_e == ids_g
        assert torch.allclose(torch.tensor(lp_e), torch.tensor(lp_g), atol=1e-4, rtol=0)


def _graph_buckets_used(llm: LLM) -> set[tuple[int, int]]:
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "CUDA graphs were not captured"
    used: set[tuple[int, int]] = set()
    replay = graphs.replay

    def noting(bucket: tuple[int, int]) -> Any:
        used.add(bucket)
        return replay(bucket)

    graphs.replay = noting
    return used


def assert_every_bucket_replays(llm: LLM, expected: dict[int, list]) -> None:
    """Each batch of ``BATCHES`` on ``llm`` gives ``expected[batch]``, every graph bucket is replayed and
    no block is left; then ``llm`` is shut down."""
    used = _graph_buckets_used(llm)
    for n in BATCHES:
        _compare(expected[n], _run(llm, _prompts(n)))
    assert {tokens for tokens, _ in used} == set(llm.engine.runner.graphs.buckets)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


def test_graph_replay_equals_eager_for_every_bucket(folder: Path) -> None:
    eager_llm = _llm(folder, graphs=False)
    eager = {n: _run(eager_llm, _prompts(n)) for n in BATCHES}
    sampled_eager = _run(eager_llm, _prompts(9), temperature=0.9, top_p=0.9, seed=5)
    eager_llm.shutdown()
    llm = _llm(folder, graphs=True)
    used = _graph_buckets_used(llm)
    for n in BATCHES:
        _compare(eager[n], _run(llm, _prompts(n)))
    _compare(sampled_eager, _run(llm, _prompts(9), temperature=0.9, top_p=0.9, seed=5))
    assert {tokens for tokens, _ in used} == set(llm.engine.runner.graphs.buckets)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


def test_deepseek_v4_decode_steps_replay_graphs_equal_eager(tmp_path: Path) -> None:
    """DeepSeek-V4 (per-request state slots): decode steps replay graphs of every bucket — compressor
    windows closing inside the graph, padding on state slot 0 — with the eager run's tokens and
    logprobs, also under the overlapped executor; every block comes back."""
    from test_deepseek_v4 import V4_BASE

    (tmp_path / "config.json").write_text(json.dumps(
        {**V4_BASE, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}))
    eager_llm = _llm(tmp_path, graphs=False, load_format="dummy")
    eager = {n: _run(eager_llm, _prompts(n)) for n in BATCHES}
    eager_llm.shutdown()
    for plugins in ({}, {"scheduling": {"enabled": True}}):
        assert_every_bucket_replays(_llm(tmp_path, graphs=True, load_format="dummy", plugins=plugins), eager)


def test_deepseek_v41_decode_steps_replay_graphs_equal_eager(tmp_path: Path) -> None:
    """DeepSeek-V4.1 (cross-layer sharing, candidate blocks, C1/C2 compressors, shifted hyper-connections):
    decode steps replay graphs of every bucket with the eager run's tokens and logprobs, also under the
    overlapped executor; every block comes back."""
    from test_deepseek_v41 import v41_config

    (tmp_path / "config.json").write_text(json.dumps(v41_config()))
    eager_llm = _llm(tmp_path, graphs=False, load_format="dummy")
    eager = {n: _run(eager_llm, _prompts(n)) for n in BATCHES}
    eager_llm.shutdown()
    for plugins in ({}, {"scheduling": {"enabled": True}}):
        assert_every_bucket_replays(_llm(tmp_path, graphs=True, load_format="dummy", plugins=plugins), eager)


@pytest.mark.parametrize(("drafter", "plan"), [("oracle", "fixed"), ("oracle", "varlen"), ("mtp", "fixed")])
def test_deepseek_v4_verification_steps_replay_graphs_equal_eager(tmp_path: Path, drafter: str, plan: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V4 verification steps (up to 1 + 3 query tokens per request) replay graphs — the
    compressors updated on the device (``Compressor._update_rows``), windows closing inside the graph,
    padding on state slot 0, the ``mtp`` drafter reading the replayed graph's final streams — with the
    eager run's greedy tokens and logprobs, drafts accepted and rolled back; every block comes back."""
    from spec_setup import known_drafts, write_oracle_file
    from test_deepseek_v4 import V4_BASE

    (tmp_path / "config.json").write_text(json.dumps(
        {**V4_BASE, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}))
    prompts = _prompts(9)
    eager_llm = _llm(tmp_path, graphs=False, load_format="dummy")
    eager = _run(eager_llm, prompts)
    eager_llm.shutdown()
    spec = {"enabled": True, "drafter": drafter, "max_draft": 3, "plan": plan}
    known = [ids for ids, _ in eager]
    if drafter == "oracle":
        spec.update(oracle_file=write_oracle_file(tmp_path, prompts, known), oracle_corruption=0.3)
    else:  # the MTP layer runs on each step's final streams; its proposals are replaced by known ones
        known_drafts(monkeypatch, [p + ids for p, ids in zip(prompts, known, strict=True)], V4_BASE["vocab_size"])
    llm = _llm(tmp_path, graphs=True, load_format="dummy", plugins={"spec_decode": spec})
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.keeps(runner.hidden_layers)
    used = _graph_buckets_used(llm)
    _compare(eager, _run(llm, prompts))
    assert any(qlen == 4 for _, qlen in used), "no verification step replayed a graph"
    stats = llm.get_stats()
    assert stats["spec_decode"]["verify_steps"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


def test_router_stats_of_replayed_steps_count_only_real_tokens(tmp_path: Path) -> None:
    folder = save_tiny_v3(tmp_path)
    top_k = json.loads((folder / "config.json").read_text())["num_experts_per_tok"]
    llm = _llm(folder, graphs=True)
    used = _graph_buckets_used(llm)
    steps: list[tuple[int, torch.Tensor]] = []
    llm.engine.core.on_step_end = lambda s: steps.append((s.num_prefill_tokens + s.num_decode_tokens, s.router_loads))
    _run(llm, _prompts(5))  # 5 decode rows replay the 8-token bucket: 3 padding rows
    assert (8, 1) in used and steps
    for tokens, loads in steps:
        assert torch.equal(loads.sum(dim=1).cpu(), torch.full((loads.shape[0],), tokens * top_k))
    llm.shutdown()


def _eager_and_oracle(folder: Path, prompts: list[list[int]], tmp_path: Path, plan: str,
                      **oracle: Any) -> tuple[list, dict]:
    """The eager run without speculation, and the ``spec_decode`` section of an ``oracle`` drafter that
    proposes its greedy continuations (``oracle``: further drafter settings, e.g. planted corruptions, so
    that every verification path runs: accept, reject, bonus)."""
    eager_llm = _llm(folder, graphs=False)
    eager = _run(eager_llm, prompts)
    eager_llm.shutdown()
    path = tmp_path / "oracle.jsonl"
    path.write_text("\n".join(json.dumps({"token_ids": p + ids}) for p, (ids, _) in zip(prompts, eager, strict=True)))
    return eager, {"enabled": True, "drafter": "oracle", "oracle_file": str(path), "max_draft": 3, "plan": plan,
                   **oracle}


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
def test_graphs_under_speculative_decoding_equal_eager(folder: Path, plan: str, tmp_path: Path) -> None:
    prompts = _prompts(9)
    eager, spec = _eager_and_oracle(folder, prompts, tmp_path, plan)
    llm = _llm(folder, graphs=True, plugins={"spec_decode": spec})
    used = _graph_buckets_used(llm)
    _compare(eager, _run(llm, prompts))
    assert any(qlen == 4 for _, qlen in used), "no verification step replayed a graph"
    llm.shutdown()


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
def test_follow_up_rows_under_overlap_replay_graphs_equal_eager_without_a_sync(folder: Path, plan: str,
                                                                              tmp_path: Path) -> None:
    """Speculative decoding under the overlapped executor with CUDA graphs and the sync guard on: requests
    whose step is in flight run as follow-up rows (engine/followup.py), drafted and fixed up on the device
    without a host read; greedy tokens and logprobs equal eager decoding without speculation."""
    prompts = _prompts(9)
    eager, spec = _eager_and_oracle(folder, prompts, tmp_path, plan, oracle_corruption=0.3)
    llm = _llm(folder, graphs=True, plugins={"spec_decode": spec, "scheduling": {"enabled": True, "sync_guard": True}})
    core, follow_ups = llm.engine.core, []
    schedule = core.schedule

    def spy() -> Any:
        scheduled = schedule()
        follow_ups.extend(row.follows for row in scheduled.batch.scheduled)
        return scheduled

    core.schedule = spy
    used = _graph_buckets_used(llm)
    _compare(eager, _run(llm, prompts))
    assert sum(follow_ups) > len(follow_ups) / 2, "requests did not follow their steps in flight"
    assert any(qlen == 4 for _, qlen in used), "no verification step replayed a graph"
    llm.shutdown()


@pytest.mark.parametrize("executor", ["sync", "overlap"])
def test_steps_with_prompt_rows_replay_the_pieces_equal_eager(folder: Path, executor: str) -> None:
    """Steps with prompt rows replay the forward captured in pieces cut at the attention calls
    (``engine/piecewise.py``): greedy tokens and logprobs equal eager execution, also when requests join
    one by one beside decoding ones, under the overlapped executor with no sync; every block comes back."""
    prompts = _prompts(9)
    eager_llm = _llm(folder, graphs=False)
    eager = _run(eager_llm, prompts)
    eager_llm.shutdown()
    plugins = {"scheduling": {"enabled": True, "sync_guard": True}} if executor == "overlap" else {}
    llm = _llm(folder, graphs=True, plugins=plugins, max_num_batched_tokens=48)  # prompts chunked beside decodes
    piecewise = llm.engine.runner.piecewise
    assert piecewise is not None, "the piecewise graphs were not captured"
    _compare(eager, _run(llm, prompts))
    assert piecewise.replays > 0
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


def _dspark_llm(folder: Path, executor: str) -> LLM:
    """An engine with CUDA graphs and the ``dspark`` drafter (random weights, ``fixed``-3), on the ``executor``
    (``overlap``: with the sync guard)."""
    plugins: dict[str, Any] = {"spec_decode": {"enabled": True, "drafter": "dspark", "dspark_weights": "random",
                                               "plan": "fixed", "max_draft": 3}}
    if executor == "overlap":
        plugins["scheduling"] = {"enabled": True, "sync_guard": True}
    return _llm(folder, graphs=True, plugins=plugins)


@pytest.mark.parametrize("executor", ["sync", "overlap"])
def test_dspark_steps_replay_graphs_equal_eager(folder: Path, executor: str) -> None:
    """``dspark`` has the model capture its target layers before the graphs are captured, so the graphs
    keep those features and its engine's decode and verification steps replay (they ran eagerly before);
    greedy tokens equal eager decoding without speculation, under the overlapped executor with no sync."""
    prompts = _prompts(9)
    eager_llm = _llm(folder, graphs=False)
    eager = _run(eager_llm, prompts)
    eager_llm.shutdown()
    llm = _dspark_llm(folder, executor)
    used = _graph_buckets_used(llm)
    _compare(eager, _run(llm, prompts))
    assert any(qlen == 4 for _, qlen in used), "no verification step replayed a graph"
    assert llm.get_stats()["spec_decode"]["verify_steps"] > 0
    llm.shutdown()


@pytest.mark.parametrize("executor", ["sync", "overlap"])
def test_dspark_speculative_tail_replays_one_graph_equal_eager(folder: Path, executor: str) -> None:
    """Greedy requests without logprobs: each verification step's tail (verification, the drafter's inputs,
    its passes, the proposal's masks) replays one captured graph (``engine/tail_graphs.py``), and the greedy
    tokens equal eager decoding without speculation, under the overlapped executor with no sync; every block
    comes back."""
    prompts = _prompts(9)
    eager_llm = _llm(folder, graphs=False)
    eager = _run(eager_llm, prompts, logprobs=None)
    eager_llm.shutdown()
    llm = _dspark_llm(folder, executor)
    tail = llm.engine.core.tail
    assert tail is not None, "the speculative tail's graphs were not built"
    outputs = _run(llm, prompts, logprobs=None)
    assert [ids for ids, _ in outputs] == [ids for ids, _ in eager]
    assert tail.replays > 0 and tail.tails, "no tail replayed a graph"
    stats = llm.get_stats()
    assert stats["spec_decode"]["verify_steps"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_dspark_drafting_replays_its_own_graphs_equal_to_eager_drafting(folder: Path, sampling: bool) -> None:
    """The dspark drafter captures its context write and block pass in CUDA graphs (``draft_graphs``): at
    every drafting step the replayed drafts equal an eager block pass over the same inputs (tokens exactly,
    confidences and distributions to 1e-4), and the context rows the graph wrote equal ``context_kv`` of the
    step's features recomputed eagerly. The comparisons accumulate on the device (no sync under overlap)."""
    plugins: dict[str, Any] = {"spec_decode": {"enabled": True, "drafter": "dspark", "dspark_weights": "random",
                                               "plan": "fixed", "max_draft": 3},
                               "scheduling": {"enabled": True, "sync_guard": True}}
    llm = _llm(folder, graphs=True, plugins=plugins)
    drafter = llm.engine.speculator.drafter
    drafter = getattr(drafter, "inner", drafter)
    propose = drafter.propose
    dev = torch.device("cuda")
    errors = {"tokens": torch.zeros((), dtype=torch.int64, device=dev),
              "confidence": torch.zeros((), device=dev), "probs": torch.zeros((), device=dev),
              "context": torch.zeros((), device=dev)}
    drafted = [0]

    @torch.inference_mode()
    def checking(inputs: Any) -> Any:
        proposal = propose(inputs)
        rows = inputs.rows
        if not inputs.last_tokens.shape[0]:  # no request drafts: the rows wait (DSparkDrafter.pending)
            return proposal
        drafted[0] += 1
        real = rows.ctx.slot_mapping != 0  # padding rows write the scratch slot 0
        written = drafter.context[rows.ctx.slot_mapping]
        expected = drafter.network.context_kv(rows.hidden, rows.ctx.positions, drafter.linear)
        gap = ((written - expected).abs().amax(dim=(1, 2, 3)) * real).max()
        errors["context"] = torch.maximum(errors["context"], gap)
        slots, visible = drafter.window_slots(rows, inputs.positions - 1)
        tokens, probs, confidence = drafter.draft(slots, visible, inputs.last_tokens, inputs.positions,
                                                  inputs.temperature, inputs.seeds, inputs.k, inputs.sampling)
        errors["tokens"] += (tokens != proposal.tokens).sum()
        errors["confidence"] = torch.maximum(errors["confidence"], (confidence - proposal.confidence).abs().max())
        if probs is not None:
            errors["probs"] = torch.maximum(errors["probs"], (probs - proposal.probs).abs().max())
        return proposal

    drafter.propose = checking
    _run(llm, _prompts(9), **({"temperature": 0.8, "seed": 3} if sampling else {}))
    assert drafter.draft_graphs is not None and drafter.write_graphs is not None
    assert drafter.draft_graphs.graphs and drafter.write_graphs.graphs, "the drafter captured no graph"
    assert drafted[0] > 0
    assert errors["tokens"].item() == 0
    assert errors["confidence"].item() < 1e-4 and errors["probs"].item() < 1e-4 and errors["context"].item() < 1e-4
    llm.shutdown()


def test_graphs_under_the_overlapped_executor_equal_eager(folder: Path) -> None:
    prompts = _prompts(17)
    eager_llm = _llm(folder, graphs=False)
    eager = _run(eager_llm, prompts)
    eager_llm.shutdown()
    llm = _llm(folder, graphs=True, plugins={"scheduling": {"enabled": True}})
    used = _graph_buckets_used(llm)
    _compare(eager, _run(llm, prompts))
    assert used
    llm.shutdown()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8, min_p=0.15),
], ids=["t1", "topk", "topp", "minp"])
def test_sampling_on_the_device_draws_the_target_distribution(params: SamplingParams) -> None:
    torch.manual_seed(11)
    logits = torch.randn(12) * 1.5
    n = 40000
    device = torch.device("cuda")
    batch = SamplingBatch.build([params] * n, [1234] * n, list(range(n)), device)
    tokens = sample(logits.to(device).expand(n, -1).contiguous(), batch).tokens.cpu()
    counts = torch.bincount(tokens, minlength=12).double()
    assert _chi_square_p(counts, _expected(logits, params)) > 1e-3
    cpu = sample(logits.expand(n, -1).contiguous(), SamplingBatch.build([params] * n, [1234] * n, list(range(n)),
                                                                         torch.device("cpu"))).tokens
    # Counter-based draws: the device picks the CPU's token except where float rounding moves a boundary.
    assert (tokens == cpu).float().mean() > 0.999
