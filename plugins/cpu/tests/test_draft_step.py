"""The fused drafting passes (``draft_step.py``, ``csrc/draft_step.c``): a ``dspark`` drafter's context write and
greedy block pass in one C call each. They equal the drafter's torch modules (the same context rows within
rounding, the same drafts, confidences within 1e-3) in float32 and bfloat16, with and without a draft vocabulary,
over windows partly visible; in the engine they serve every batch-1 drafting step and propose what the torch
modules propose (in bfloat16 but for a rare near tie), greedy tokens staying those of plain decoding; and they
decline what they do not serve (sampling drafts, too many rows, the switch off)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepinfer_cpu.cbuild import compiler
from deepinfer_spec_decode.dspark import DSparkDrafter, DSparkNetwork, save_weights
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.ops import init_dummy

pytestmark = [pytest.mark.skipif(compiler() is None, reason="no C compiler"),
              pytest.mark.usefixtures("one_torch_thread")]

K = 4
HIDDEN, VOCAB, DRAFT_VOCAB = 64, 256, 96  # the tiny llama's; a draft vocabulary of 96 of its 256 ids


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))[1]


@pytest.fixture(scope="module")
def reduced_weights(tmp_path_factory) -> Path:
    """A two-layer drafter over a draft vocabulary (a shuffled ``d2t``), random weights."""
    network = DSparkNetwork(HIDDEN, 1, VOCAB, num_layers=2, heads=4, intermediate=128, markov_rank=32,
                            dtype=torch.float32, device=torch.device("cpu"), draft_vocab_size=DRAFT_VOCAB)
    init_dummy(network, 7)
    network.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB])
    path = tmp_path_factory.mktemp("drafter") / "reduced.safetensors"
    save_weights(network, path)
    return path


def _llm(folder: Path, dtype: str, weights: str = "random", fused: bool = True, **spec) -> LLM:
    layers = {"dspark_num_layers": 2, "dspark_intermediate_size": 128} if weights != "random" else {}
    return LLM(folder, dtype=dtype, block_size=16, kv_cache_bytes=1 << 22, max_num_seqs=1,
               plugins={"cpu": {"enabled": True, "fused_draft": fused},
                        "spec_decode": {"enabled": True, "drafter": "dspark", "plan": "fixed", "max_draft": K,
                                        "dspark_weights": weights, "dspark_context_window": 8, **layers, **spec}})


def _drafter(llm: LLM) -> DSparkDrafter:
    drafter = llm.engine.speculator.drafter
    return getattr(drafter, "inner", drafter)  # under the plugin's calibration wrapper


def _bound(llm: LLM) -> DSparkDrafter:
    """The drafter after one short request (bound to the engine's GEMM backend)."""
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    return _drafter(llm)


def _torch_path(drafter: DSparkDrafter):
    """Run the next calls through the drafter's torch modules."""
    stack = drafter.stack

    class Restore:
        def __enter__(self):
            drafter.stack = None

        def __exit__(self, *exc):
            drafter.stack = stack

    return Restore()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocabulary", ["whole", "reduced"])
def test_fused_passes_equal_the_torch_modules(llama_dir, reduced_weights, dtype, vocabulary):
    llm = _llm(llama_dir, dtype, str(reduced_weights) if vocabulary == "reduced" else "random")
    drafter = _bound(llm)
    assert drafter.stack is not None
    gen = torch.Generator().manual_seed(0)
    cache_dtype = drafter.context.dtype
    rows, slots = 6, torch.randperm(drafter.context.shape[0] - 1, generator=gen)[:6] + 1
    features = torch.randn(rows, HIDDEN, generator=gen).to(cache_dtype)
    positions = torch.randint(0, 400, (rows,), generator=gen)
    with torch.inference_mode():
        assert drafter.fused.draft_context(drafter.stack, features, positions, slots, drafter.context)
        fused = drafter.context[slots].clone()
        with _torch_path(drafter):
            drafter.write_context(features, slots, positions)
        reference = drafter.context[slots]
        torch.testing.assert_close(fused.float(), reference.float(), rtol=1e-2 if dtype == "bfloat16" else 1e-5,
                                   atol=1e-5)
        # two requests' blocks over windows of 8 cache rows: the first sees all of its window, the second 3 rows
        window = torch.randint(1, drafter.context.shape[0], (2, 8), generator=gen)
        visible = torch.ones(2, 8, dtype=torch.bool)
        visible[1, :5] = False
        drafter.context[window.flatten()] = torch.randn(16, *drafter.context.shape[1:], generator=gen).to(cache_dtype)
        last, at = torch.tensor([17, 200]), torch.tensor([30, 3])
        greedy = (torch.zeros(2), torch.zeros(2, dtype=torch.int64))
        tokens, probs, confidence = drafter.draft(window, visible, last, at, *greedy, K, False)
        with _torch_path(drafter):
            ref_tokens, _, ref_confidence = drafter.draft(window, visible, last, at, *greedy, K, False)
    assert probs is None and tokens.dtype == torch.int64 and tokens.shape == (2, K)
    assert torch.equal(tokens, ref_tokens)
    if vocabulary == "reduced":
        assert set(tokens.flatten().tolist()) <= set(drafter.network.d2t.tolist())
    torch.testing.assert_close(confidence, ref_confidence, rtol=0, atol=1e-3)
    llm.shutdown()


def _proposals(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    drafter = _drafter(llm)
    proposals, propose = [], drafter.propose

    def recording(inputs):
        proposal = propose(inputs)
        proposals.append(proposal.tokens.clone())
        return proposal

    drafter.propose = recording
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs, proposals


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_drafts_through_the_fused_passes_as_through_the_modules(llama_dir, reduced_weights, dtype):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 21, 40)]
    fused = _llm(llama_dir, dtype, str(reduced_weights))
    outs, proposals = _proposals(fused, prompts)
    served = _drafter(fused).fused.draft_block.__self__  # the backend's FusedDrafter
    plain = _llm(llama_dir, dtype, str(reduced_weights), fused=False)
    ref_outs, ref_proposals = _proposals(plain, prompts)
    assert _drafter(plain).fused is None
    assert outs == ref_outs
    assert len(proposals) == len(ref_proposals) > 20
    # float32: every proposal the same; bfloat16: a near tie may fall the other way under the other summation
    # orders (1 of 71 proposals here)
    differing = sum(not torch.equal(a, b) for a, b in zip(proposals, ref_proposals, strict=True))
    assert differing <= (0 if dtype == "float32" else len(proposals) // 20)
    # every drafting step's block pass and context write (the prefill's rows too, when they fit)
    assert served.calls >= len(proposals)
    off = LLM(llama_dir, dtype=dtype, block_size=16, kv_cache_bytes=1 << 22, max_num_seqs=1,
              plugins={"cpu": {"enabled": True}})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert outs == [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    for llm in (fused, plain, off):
        llm.shutdown()


def test_what_the_fused_passes_decline(llama_dir):
    llm = _llm(llama_dir, "float32")
    drafter = _bound(llm)
    backend, stack = drafter.fused, drafter.stack
    passes = backend.draft_block.__self__  # the backend's FusedDrafter
    too_many = passes.max_rows(torch.float32) + 1
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        features = torch.randn(too_many, HIDDEN, generator=gen)
        before = drafter.context.clone()
        rows = torch.arange(too_many)
        assert not backend.draft_context(stack, features, rows, rows + 1, drafter.context)
        assert torch.equal(drafter.context, before)
        embedded = torch.randn(too_many, 1, HIDDEN, generator=gen)
        window = torch.ones(too_many, 8, dtype=torch.int64)
        assert backend.draft_block(stack, drafter.context, window, window.bool(), embedded, rows, rows) is None
        # a sampling request's drafts (their distributions reported) stay with the torch modules
        calls = passes.calls
        sampled = drafter.draft(window[:1], window[:1].bool(), torch.tensor([3]), torch.tensor([9]),
                                torch.tensor([0.8]), torch.tensor([11]), K, True)
        assert sampled[1] is not None and passes.calls == calls
    llm.shutdown()
    off = _bound(_llm(llama_dir, "float32", fused=False))
    assert off.fused is None and off.stack is None
