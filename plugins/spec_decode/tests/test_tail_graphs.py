"""The speculative tail replayed as one graph (``engine/tail_graphs.py``), emulated on CPU.

``DecodeGraphs(..., emulate=True)`` replays the target's steps on the static buffers and ``TailGraphs(...,
emulate=True)`` runs the captured tail eagerly on its own: the packed inputs, their padding (samplers to
their bucket, emitted rows to the target's bucket), the greedy verification of ``max_draft`` columns and the
drafting over the bucket's static features. With ``dspark`` proposing the known greedy continuation with
planted corruptions (so drafts are accepted and rolled back), under both plans and both executors: the
greedy tokens equal decoding without speculation; with ``fixed`` the verification statistics equal the
eager tail's on the same emulated target graphs (``varlen`` grants by measured step times); steps with
padding rows and samplers went through the tail; every block comes back. The capture itself runs on the
GPU (``tests/test_gpu_graphs.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from deepinfer_spec_decode.dspark import DSparkDrafter
from spec_setup import known_drafts
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.engine.graphs import DecodeGraphs
from deepinfer.engine.tail_graphs import TailGraphs, TailStep

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
VOCAB = 256
BLOCK = 16
MAX_SEQS = 5
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 25, (), generator=gen)),), generator=gen).tolist()
            for _ in range(7)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))[1]


@pytest.fixture(scope="module")
def reference(folder: Path) -> list[list[int]]:
    llm = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, max_num_seqs=MAX_SEQS)
    outs = [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]
    llm.shutdown()
    return outs


def _emulated(llm: LLM, tail: bool) -> tuple[list[tuple[TailStep, bool]], TailGraphs | None]:
    """Put emulated target graphs (host lists made exact before each replay: the CPU attention reads them) and,
    with ``tail``, emulated tail graphs into ``llm``'s engine; returns the list the staged tails go to, each with
    whether the step had follow-up rows."""
    engine = llm.engine
    graphs = DecodeGraphs(engine.model, engine.runner.backends, BLOCK, torch.device("cpu"),
                          max_tokens=MAX_SEQS * (1 + K), max_query_lens=(1, 1 + K),
                          max_blocks=engine.kv.blocks_needed(engine.max_model_len), emulate=True)
    graphs.capture()
    replay = graphs.replay

    def replaying(bucket: tuple[int, int]) -> Any:  # after the fix-up of follow-up rows, as the forward sees it
        engine.runner.exact_host_lists(graphs.graphs[bucket].ctx)
        return replay(bucket)

    graphs.replay = replaying
    engine.runner.graphs = graphs
    staged: list[tuple[TailStep, bool]] = []
    if not tail:
        return staged, None
    tails = TailGraphs(graphs, engine.speculator, engine.runner.hidden_layers, emulate=True)
    stage = tails.stage

    def staging(inputs: Any) -> TailStep | None:
        step = stage(inputs)
        if step is not None:
            staged.append((step, inputs.followups is not None))
        return step

    tails.stage = staging
    engine.core.tail = tails
    return staged, tails


def _run(folder: Path, plan: str, executor: str, tail: bool
         ) -> tuple[list[list[int]], dict, list[tuple[TailStep, bool]], LLM]:
    plugins: dict[str, Any] = {"spec_decode": {"enabled": True, "drafter": "dspark", "dspark_weights": "random",
                                               "plan": plan, "max_draft": K}}
    if executor == "overlap":
        plugins["scheduling"] = {"enabled": True}
    llm = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, max_num_seqs=MAX_SEQS, plugins=plugins,
              scheduler={"executor": executor})
    staged, _ = _emulated(llm, tail)
    outs = [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]
    return outs, llm.get_stats(), staged, llm


@pytest.mark.parametrize("executor", ["sync", "overlap"])
@pytest.mark.parametrize("plan", ["fixed", "varlen"])
def test_the_replayed_tail_equals_the_eager_tail_and_decoding_without_speculation(folder, reference, plan, executor,
                                                                                 monkeypatch):
    known_drafts(monkeypatch, [p + r for p, r in zip(_prompts(), reference, strict=True)], VOCAB, DSparkDrafter)
    eager_tail, eager_stats, _, llm = _run(folder, plan, executor, tail=False)
    llm.shutdown()
    outs, stats, staged_steps, llm = _run(folder, plan, executor, tail=True)
    assert outs == reference and eager_tail == reference
    staged = [step for step, _ in staged_steps]
    assert staged, "no step went through the tail"
    assert any(s.verifying for s in staged), "no verification step went through the tail"
    assert any(s.num_samplers < s.key[1] for s in staged), "no tail padded its samplers"
    assert any(len(s.plan.emitted_rows) < s.key[0] for s in staged), "no tail padded its rows"
    if executor == "overlap":
        assert any(follows for _, follows in staged_steps), "no follow-up row moved under the tail"
    spec, eager_spec = stats["spec_decode"], eager_stats["spec_decode"]
    assert 1.2 < spec["mean_acceptance_length"] < 1 + K  # drafts accepted and rolled back
    if plan == "fixed":  # (varlen's grants follow measured step times: they differ from run to run)
        for field in ("mean_acceptance_length", "verify_steps", "acceptance_per_position"):
            assert spec[field] == eager_spec[field], field
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()
