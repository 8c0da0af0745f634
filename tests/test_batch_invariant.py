"""Batch-invariant mode (``kernels.batch_invariant``): one request's logprobs are bitwise the same
alone and in any batch, and seeded sampling gives the same tokens whatever the neighbours and the
executor (docs/design.md, "Batch invariance and deterministic sampling").

Compositions vary the batch size, the neighbours' prompt lengths, the target's position in the batch,
chunked prefill (a small token budget splits prompts differently) and prefill mixed with decode (the
target arrives while its neighbours decode). Speculative decoding with the ``fixed`` plan is covered
(verification rows are per-request, multi-token queries of the same invariant kernels); ``varlen`` is
refused. DeepSeek-V4 is not covered: its attention has no batch-invariant backend (see the design note).
"""

from __future__ import annotations

import pytest
import torch
from batch_invariance import check_fixed_speculation, check_invariance, generate_among, neighbour_ids

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.interfaces import RunRequirements
from deepinfer.model.layers.batch_invariant import (
    ROW_CHUNK,
    BatchInvariantAttentionBackend,
    BatchInvariantGemmBackend,
    BatchInvariantMLABackend,
    BatchInvariantMoEBackend,
    chunked_linear,
    fixed_split_attention,
)
from deepinfer.model.layers.norm import BATCH_INVARIANT_CUDA_ROWS, RMSNorm
from deepinfer.model.layers.reference import TorchGemmBackend
from deepinfer.model.layers.routing import row_sigmoid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET_TOKENS = 6

COMPOSITIONS = [
    # (neighbour prompt lengths, target index, delay steps)
    ([], 0, 0),
    ([5], 0, 0),
    ([5], 1, 0),
    ([40, 3], 1, 0),
    ([17, 17, 17], 3, 0),
    ([2, 60, 9, 31, 4], 2, 0),
    ([8] * 9, 5, 0),
    ([25, 6], 0, 2),
    ([3, 45, 12], 1, 3),
    ([50, 1, 33, 7], 4, 1),
    ([70], 0, 0),
    ([11, 13, 15, 19, 23, 29, 31], 7, 4),
]


def _check_invariance(llm: LLM, vocab: int, prompt_len: int) -> None:
    check_invariance(llm, vocab, prompt_len, COMPOSITIONS, TARGET_TOKENS)


@pytest.fixture(scope="module")
def smol_bi(smollm2_dir):
    # A small token budget makes chunked prefill split the target's prompt differently per composition.
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=512, block_size=16,
              max_num_batched_tokens=96, kernels={"batch_invariant": True})
    yield llm
    llm.shutdown()


def test_batch_invariant_mode_selects_the_invariant_backends(smol_bi):
    names = {op: b.name for op, b in smol_bi.engine.runner.backends.items() if op in ("linear", "paged_attention")}
    assert names == {"linear": "batch_invariant", "paged_attention": "batch_invariant"}
    # RMSNorm pads short batches on CUDA in this mode only (norm.mean_square).
    norms = [m for m in smol_bi.engine.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.min_cuda_rows == BATCH_INVARIANT_CUDA_ROWS for m in norms)


def test_smollm2_logprobs_bitwise_equal_in_every_batch(smol_bi):
    _check_invariance(smol_bi, 49152, prompt_len=37)


def test_fixed_speculation_keeps_outputs_bitwise_equal_in_every_batch(smollm2_dir):
    """Deterministic speculative decoding (issue 28 item 4): under ``kernels.batch_invariant`` with the
    ``fixed`` plan, a target whose prompt repeats (so ``ngram`` drafts and some drafts are accepted)
    gets bitwise the tokens and logprobs it gets alone, greedy and seeded-sampled, in every batch."""
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=512, block_size=16, max_num_batched_tokens=96,
              kernels={"batch_invariant": True},
              plugins={"spec_decode": {"enabled": True, "drafter": "ngram", "plan": "fixed", "max_draft": 4}})
    try:
        check_fixed_speculation(llm, 49152, COMPOSITIONS, TARGET_TOKENS)
        assert llm.get_stats()["spec_decode"]["mean_acceptance_length"] > 1.0  # SmolLM2 copies the repetition
    finally:
        llm.shutdown()


def test_varlen_speculation_is_refused_under_batch_invariance(smollm2_dir):
    with pytest.raises(ConfigError, match=r"cannot be combined with kernels\.batch_invariant"):
        LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=512, kernels={"batch_invariant": True},
            plugins={"spec_decode": {"enabled": True, "drafter": "ngram", "plan": "varlen"}})


def test_reference_backends_are_not_batch_invariant(smollm2_dir):
    """The check above can fail: without the mode, some composition changes the target's logprobs."""
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=512, block_size=16, max_num_batched_tokens=96)
    assert all(m.min_cuda_rows == 1 for m in llm.engine.model.modules() if isinstance(m, RMSNorm))
    try:
        with pytest.raises(AssertionError, match="differ"):
            _check_invariance(llm, 49152, prompt_len=37)
    finally:
        llm.shutdown()


def test_seeded_sampling_is_deterministic_across_neighbours_and_executors(smollm2_dir):
    """Five runs, each with other neighbours, under the synchronous and the overlapped executor."""
    target = neighbour_ids(7, 21, 49152)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True, logprobs=2)
    results = {}
    for executor in ("sync", "overlap"):
        llm = LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=512, block_size=16,
                  max_num_batched_tokens=96, kernels={"batch_invariant": True},
                  plugins={"scheduling": {"enabled": executor == "overlap"}}, scheduler={"executor": executor})
        try:
            assert type(llm.engine.executor).__name__ == ("SyncExecutor" if executor == "sync" else "OverlapExecutor")
            runs = [generate_among(llm, target, params,
                                   [neighbour_ids(50 + r * 7 + j, 4 + 9 * j + r, 49152) for j in range(r)],
                                   neighbour_tokens=TARGET_TOKENS, target_index=r // 2, delay_steps=r % 2)
                    for r in range(5)]
        finally:
            llm.shutdown()
        assert all(run == runs[0] for run in runs[1:]), executor
        results[executor] = runs[0]
    assert results["sync"] == results["overlap"]


@pytest.fixture(scope="module")
def tiny_v3_dir(tmp_path_factory):
    """A tiny random DeepSeek-V3 (MLA, MoE with a shared expert, one dense layer first)."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    from tiny_models import randomize

    randomize(model, torch.Generator().manual_seed(1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    folder = tmp_path_factory.mktemp("tiny-v3")
    model.save_pretrained(folder)
    return folder


def test_tiny_deepseek_v3_logprobs_bitwise_equal_in_every_batch(tiny_v3_dir):
    llm = LLM(tiny_v3_dir, kv_cache_bytes=1 << 24, max_model_len=512, block_size=16, max_num_batched_tokens=96,
              kernels={"batch_invariant": True})
    try:
        names = {op: llm.engine.runner.backends[op].name for op in ("linear", "mla_attention", "experts")}
        assert names == {"linear": "batch_invariant", "mla_attention": "batch_invariant_mla",
                         "experts": "batch_invariant"}
        _check_invariance(llm, 256, prompt_len=29)
    finally:
        llm.shutdown()


def test_batch_invariant_outputs_stay_close_to_the_reference(smollm2_dir, smol_bi):
    """The mode changes rounding, not the model: greedy text matches the reference backends'."""
    prompt = "The three primary colors are"
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = LLM(smollm2_dir, kv_cache_bytes=1 << 27, max_model_len=512)
    try:
        expected = ref.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        ref.shutdown()
    assert smol_bi.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_chunked_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 96, generator=g)
    row = torch.randn(1, 96, generator=g)
    alone = chunked_linear(row, weight)
    for rows, at in ((2, 1), (ROW_CHUNK, 0), (ROW_CHUNK + 3, ROW_CHUNK + 1), (70, 33)):
        batch = torch.randn(rows, 96, generator=g)
        batch[at] = row[0]
        assert torch.equal(chunked_linear(batch, weight)[at], alone[0])
    torch.testing.assert_close(alone, row @ weight.t(), rtol=1e-5, atol=1e-5)


def test_fixed_split_attention_matches_sdpa_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 150, 2, 8, generator=g), torch.randn(1, 150, 2, 8, generator=g)
    q = torch.randn(1, 3, 2, 2, 8, generator=g)  # 3 queries, 2 KV heads, 2 query heads each
    pos = torch.tensor([[70, 71, 72]])
    out = fixed_split_attention(q, keys, values, pos, scale=0.3)
    # The same queries against keys padded with garbage past position 72 give the same bits.
    padded_k = torch.cat([keys[:, :73], 1e3 * torch.randn(1, 200, 2, 8, generator=g)], dim=1)
    padded_v = torch.cat([values[:, :73], 1e3 * torch.randn(1, 200, 2, 8, generator=g)], dim=1)
    assert torch.equal(fixed_split_attention(q, padded_k, padded_v, pos, scale=0.3), out)
    # One query alone gives the same bits as inside the chunk.
    assert torch.equal(fixed_split_attention(q[:, 1:2], keys, values, pos[:, 1:2], scale=0.3), out[:, 1:2])
    for i, p in enumerate(pos[0].tolist()):
        k, v = keys[0, :p + 1].transpose(0, 1), values[0, :p + 1].transpose(0, 1)  # [Hkv, L, D]
        expected = torch.softmax(0.3 * torch.einsum("hgd,hld->hgl", q[0, i], k), -1) @ v
        torch.testing.assert_close(out[0, i], expected, rtol=1e-5, atol=1e-5)


def test_the_backends_declare_the_capability_on_cpu_only():
    cuda = RunRequirements(device="cuda", dtype=torch.bfloat16, kv_dtype="auto", graph_safe=False,
                           batch_invariant=True)
    cpu = RunRequirements(device="cpu", dtype=torch.float32, kv_dtype="auto", graph_safe=False,
                          batch_invariant=True)
    for backend in (BatchInvariantGemmBackend(), BatchInvariantAttentionBackend(), BatchInvariantMLABackend(),
                    BatchInvariantMoEBackend()):
        assert cpu.missing(backend.capabilities) == []
        assert cuda.missing(backend.capabilities) == ["device cuda"]
    assert cpu.missing(TorchGemmBackend().capabilities) == ["batch_invariant"]


def test_the_router_sigmoid_gives_a_row_the_same_bits_in_any_batch():
    """``routing.row_sigmoid`` (the V3 router's scores): a row's values alone equal its values among 1–70
    rows, for router widths that are and are not whole vectors (torch's plain sigmoid over a contiguous
    ``[T, E]`` gave other last bits for some ``T`` on an Intel Xeon)."""
    gen = torch.Generator().manual_seed(0)
    for experts in (8, 64, 72, 160):
        logits = torch.randn(70, experts, generator=gen) * 4
        alone = torch.cat([row_sigmoid(logits[i:i + 1]) for i in range(70)])
        torch.testing.assert_close(alone, logits.sigmoid(), rtol=0, atol=2e-7)
        for rows in (2, 3, 5, 16, 37, 70):
            assert torch.equal(row_sigmoid(logits[:rows]), alone[:rows])
