"""DeepSeek-V4 speculative verification steps replayed from emulated CUDA graphs.

``DecodeGraphs(..., emulate=True)`` replays each step on the graph's static context: the capture's host
lists (one-token requests at position 0), the bucket's padding rows on the reserved block and state
slot 0, the query-length bound 1 + K stated. With ``triton_v4`` (in Triton's CPU interpreter) serving
attention and the indexer, the greedy tokens and logprobs equal those of the eager run without
speculation, with the ``oracle`` drafter and with the ``mtp`` drafter (its MTP layer runs on the
replayed steps' final streams, steered onto known drafts so that drafts are accepted and rolled back),
under the ``fixed`` and ``varlen`` plans; every block and state slot comes back. So the compressors
(``Compressor._update_rows``), the rings and the indexer of verification steps read only device tensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from spec_setup import known_drafts, write_oracle_file
from test_deepseek_v4 import BLOCK, VOCAB, build, make_llm, prompts
from test_deepseek_v4_mtp import _write_mtp

from deepinfer import LLM, SamplingParams
from deepinfer.engine.graphs import DecodeGraphs, GraphStep

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (triton_v4)"),
    pytest.mark.usefixtures("one_torch_thread"),
]

K = 3  # drafts per request and step: verification graphs of query-length bound 4
BATCH = prompts([3, 29, 12, 7], seed=23)  # windows of the CSA (4) and HCA (8) compressors close in verify steps
PARAMS = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=0)

Outputs = list[tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny V4 (``v4-yarn``) with one upstream MTP depth."""
    path = tmp_path_factory.mktemp("v4-graphs")
    build("v4-yarn", path)
    _write_mtp(path)
    return path


def _generate(folder: Path, spec: dict | None = None, emulate: bool = False) -> tuple[Outputs, list[GraphStep], LLM]:
    """Greedy outputs of ``BATCH`` with ``triton_v4`` — (tokens, their logprobs) per prompt — the steps
    that replayed a graph (with ``emulate``), and the engine."""
    llm = make_llm(folder, plugins={"attention": {"enabled": True}, **(spec or {})},
                   kernels={"attention": "triton_v4"})
    engine, replayed = llm.engine, []
    if emulate:
        graphs = DecodeGraphs(engine.model, engine.runner.backends, BLOCK, torch.device("cpu"),
                              max_tokens=len(BATCH) * (1 + K), max_query_lens=(1, 1 + K),
                              max_blocks=engine.kv.blocks_needed(engine.max_model_len), emulate=True, stateful=True)
        graphs.capture()
        load = graphs.load
        graphs.load = lambda step: replayed.append(step) or load(step)
        engine.runner.graphs = graphs
    outs = llm.generate(BATCH, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, [d[t] for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                             strict=True)]) for o in outs], replayed, llm


@pytest.fixture(scope="module")
def eager(folder: Path) -> Outputs:
    """The eager run without speculation."""
    outputs, _, llm = _generate(folder)
    llm.shutdown()
    return outputs


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
@pytest.mark.parametrize("drafter", ["oracle", "mtp"])
def test_verification_steps_replayed_from_emulated_graphs_equal_eager(folder, eager, drafter, plan, monkeypatch,
                                                                      tmp_path):
    known = [p + ids for p, (ids, _) in zip(BATCH, eager, strict=True)]
    spec = {"enabled": True, "drafter": drafter, "plan": plan, "max_draft": K}
    if drafter == "oracle":
        spec.update(oracle_file=write_oracle_file(tmp_path, BATCH, [ids for ids, _ in eager]), oracle_corruption=0.3)
    else:  # the MTP layer runs on every step's final streams; its proposals are replaced by known ones
        known_drafts(monkeypatch, known, VOCAB)
    outputs, replayed, llm = _generate(folder, {"spec_decode": spec}, emulate=True)
    verified = [s for s in replayed if s.bucket[1] == 1 + K]
    assert verified, "no verification step replayed a graph"
    if plan == "fixed":  # (varlen verifies 1 draft per request here: 2 · 4 tokens, a whole bucket)
        assert any(s.num_tokens < s.bucket[0] for s in verified), "no verification step had padding rows"
    for (ids, logprobs), (want_ids, want_logprobs) in zip(outputs, eager, strict=True):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=0, atol=1e-5)
    stats = llm.get_stats()
    if plan == "fixed":  # planted corruptions: drafts accepted and rolled back
        assert 1.2 < stats["spec_decode"]["mean_acceptance_length"] < 1 + K
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not llm.engine.kv.slots
    llm.shutdown()
