"""DeepSeek-V4.1 (and V4) engines over V4.1's quantized KV layouts (``cache.kv_dtype`` fp4 / fp8,
``deepinfer/kv/v41_cache.py``): the pool's bytes are the formats', cached decode reads what prefill wrote, and
logits stay near the float32 (``auto``) cache's on tiny random models.

The tolerances (max |Δ logit| / max |logit| per step, on steps whose prefix is the same in both runs):
measured with 12 prompts × 8 greedy tokens on a tiny V4.1 whose every token takes all 8 experts and whose
indexer top-k holds every entry (no candidate limit), so a perturbed hidden state cannot flip a router or
indexer choice — with top-2 experts and top-6 entries one flip moves the logits by up to 0.7 × max|logit|
and a test of the format would test the model's chaos instead:

- V4.1 fp8 (main + SWA MXFP8, index keys FP4): prefill max 0.21, decode median 0.07, max 0.29; greedy token
  equal on 66 of 72 comparable steps (92%);
- V4.1 fp4 (main FP4, SWA MXFP8, index keys FP4): prefill max 0.23, decode median 0.09, max 0.23; 44 of 53
  (83%);
- V4 fp8 (everything MXFP8): prefill max 0.11, decode median 0.07, max 0.18; 61 of 69 (88%).

Asserted: every step ≤ ``STEP_TOLERANCE`` 0.4, the median ≤ 0.15, greedy agreement ≥ 75%. The SWA ring's MXFP8
dominates (its window keys are also the values, read by every layer): fp8 and fp4 err alike.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from test_deepseek_v4 import BLOCK, make_llm, prompts
from test_deepseek_v41 import FromScratch, build_v41, v41_llm
from tiny_models import record_logits, save_tiny

from deepinfer import SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.kv import fp8, v41_cache
from deepinfer.kv.fp8 import FP4_KV_DTYPE, FP8_DTYPE
from deepinfer.kv.pools import bytes_per_block, state_bytes
from deepinfer.kv.state import CompressedPart, HybridLayerSpec, RingPart
from deepinfer.kv.v41_formats import FP4_INDEX, FP4_MAIN, MXFP8

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEP_TOLERANCE = 0.4
MEDIAN_TOLERANCE = 0.15
MIN_AGREEMENT = 0.75
# Measured: ≤ 1.9e-6 on 5 of 6 runs, 3.4e-4 on one fp8 request (one value across a rounding boundary).
CONSISTENCY_TOLERANCE = 2e-3
# No discrete choice a perturbed hidden state can flip (module docstring); index keys 32 wide (FP4_INDEX's group).
STABLE = {"index_head_dim": 32, "num_experts_per_tok": 8, "index_topk": 512, "candidate_source_layer_id": None}
PROMPTS = prompts([3, 7, 12, 20, 33, 41, 9, 16, 26, 50, 5, 30], seed=5)


# ------------------------------------------------------------------------------------------------ bytes


def test_reference_shaped_parts_take_the_formats_bytes():
    """A V4.1-shaped C1 layer (512-wide entries, 128-wide index keys, a 128-token window) at block 128:
    288 + 68 bytes an entry under fp4, 528 + 68 under fp8, the ring 528 bytes a row under both; the
    compressor's ring keeps the model dtype."""
    spec = HybridLayerSpec((CompressedPart(1, 512), CompressedPart(1, 128, index=True)),
                           (RingPart(128, 512, sliding=True), RingPart(2, 1024)), "compressed", 128, 1, "plain",
                           ("fp8", "fp4"))
    c2 = HybridLayerSpec((CompressedPart(2, 512),), (), "compressed", 128, 2)
    assert spec.bytes_per_block(128, FP4_KV_DTYPE) == 128 * (288 + 68)
    assert spec.bytes_per_block(128, FP8_DTYPE) == 128 * (528 + 68)
    assert spec.bytes_per_block(128, torch.bfloat16) == 128 * (512 + 128) * 2
    assert c2.bytes_per_block(128, FP4_KV_DTYPE) == 64 * 288
    for kv_dtype in (FP4_KV_DTYPE, FP8_DTYPE):
        assert spec.bytes_per_slot(2, torch.bfloat16, kv_dtype) == 130 * 528 + 4 * 1024 * 2
    assert spec.bytes_per_slot(2, torch.bfloat16) == 130 * 512 * 2 + 4 * 1024 * 2
    entries, keys = spec.allocate(3, 128, FP4_KV_DTYPE, torch.device("cpu"))
    assert entries.dtype == keys.dtype == torch.uint8 and entries.shape == (3, 128, 288) and keys.shape == (3, 128, 68)
    ring, raw = spec.allocate_state(2, 2, torch.bfloat16, torch.device("cpu"), FP4_KV_DTYPE)
    assert ring.shape == (2, 130, 528) and ring.dtype == torch.uint8 and raw.dtype == torch.bfloat16


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_pool_bytes_per_block_are_the_formats(tmp_path, kv_dtype):
    """The engine's pool holds exactly the bytes ``bytes_per_block`` and ``state_bytes`` count, paged parts
    as uint8 records of the formats; the same budget holds more blocks than the float32 cache."""
    build_v41(tmp_path, **STABLE)
    runs = {}
    for setting in ("auto", kv_dtype):
        engine = v41_llm(tmp_path, cache={"kv_dtype": setting}).engine
        specs, pool = engine.model.cache_specs(), engine.pool
        paged = sum(t.numel() * t.element_size() for t in pool.paged)
        assert paged == pool.num_blocks * bytes_per_block(specs, BLOCK, engine.kv_dtype)
        total = sum(t.numel() * t.element_size() for layer in pool.layers for t in layer)
        assert total - paged == state_bytes(specs, pool.num_state_slots, engine.max_backtrack, engine.dtype,
                                            engine.kv_dtype)
        runs[setting] = engine, specs
    engine, specs = runs[kv_dtype]
    d = engine.model.d
    main = (FP4_MAIN if kv_dtype == "fp4" else MXFP8).at(d.head_dim)
    per_block = sum(BLOCK // r * (main.bytes_per_token + FP4_INDEX.at(d.index_dim).bytes_per_token) for r in (2, 1, 1))
    assert bytes_per_block(specs, BLOCK, engine.kv_dtype) == per_block  # source layers 1, 2 and 4 (ratios 2, 1, 1)
    ring = engine.model.layers[0].self_attn.ring
    assert ring.dtype == torch.uint8 and ring.shape[-1] == MXFP8.at(d.head_dim).bytes_per_token
    assert engine.pool.num_blocks > runs["auto"][0].pool.num_blocks


@pytest.mark.parametrize("fmt", [MXFP8.at(64), FP4_MAIN.at(64), FP4_INDEX.at(32)], ids=lambda f: f.name)
def test_writes_at_flat_rows_lay_blocks_out_as_the_format(fmt):
    """``v41_cache.write`` at scattered rows of a 3-block part gives each block the bytes the format's own block
    writer gives (records, or block-wide sections for the index keys); ``read`` decodes them back."""
    n, gen = 4, torch.Generator().manual_seed(7)
    x = torch.randn(3 * n, fmt.elements, generator=gen) * torch.logspace(-2, 1, 3 * n).unsqueeze(1)
    cache = v41_cache.allocate((3, n), fmt.elements, fmt, torch.float32, torch.device("cpu"))
    order = torch.randperm(3 * n, generator=gen)
    v41_cache.write(cache, order, x[order])
    assert v41_cache.format_of(cache, fmt.elements) == fmt
    for b in range(3):
        block = torch.zeros(fmt.block_stride(n), dtype=torch.uint8)
        fmt.write_block(block, x[b * n:(b + 1) * n], n)
        assert torch.equal(cache[b].reshape(-1), block[: n * fmt.bytes_per_token])
    assert torch.equal(v41_cache.read(cache, fmt.elements).reshape(-1, fmt.elements), v41_cache.roundtrip(x, fmt))


# -------------------------------------------------------------------------------------------- engines


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_cached_decode_reads_what_prefill_wrote(tmp_path, kv_dtype):
    """Every V4.1 feature on (shifted HC, sharing, candidate limit): chunked prefill and 24 cached decode steps
    over the quantized cache give the logits of one forward over the whole sequence on the same format, within
    ``CONSISTENCY_TOLERANCE`` × max|logit| — entries, index keys and window keys read back as written, and
    prefill attends to its window keys as decode later reads them. Not bitwise: chunked and whole-sequence
    float32 differ in the last bits, which can move a value across a rounding boundary of the format."""
    build_v41(tmp_path, index_head_dim=32)
    llm = v41_llm(tmp_path, max_num_batched_tokens=32, cache={"kv_dtype": kv_dtype})
    oracle = FromScratch(tmp_path, cache={"kv_dtype": kv_dtype})
    batch = prompts([5, 23, 40], seed=3)
    steps = record_logits(llm)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True), use_tqdm=False)
    errors = []
    for prompt, out, ours in zip(batch, outs, _by_request(steps, outs), strict=True):
        ref = oracle(torch.tensor([prompt + out.outputs[0].token_ids[:24]])).logits[0, len(prompt) - 1:]
        errors.append(((ours - ref).abs().max() / ref.abs().max()).item())
    assert max(errors) <= CONSISTENCY_TOLERANCE, errors


def _step_logits(llm) -> list[torch.Tensor]:
    steps = record_logits(llm)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return _by_request(steps, outs)


def _by_request(steps, outs) -> list[torch.Tensor]:
    """Each output's recorded logits ``[steps, V]`` (``record_logits``' rows gathered by request id)."""
    rows: dict[str, list[torch.Tensor]] = {}
    for ids, logits in steps:
        for rid, row in zip(ids, logits, strict=True):
            rows.setdefault(rid, []).append(row)
    return [torch.stack(rows[o.request_id]) for o in outs]


@pytest.fixture(scope="module")
def v4_stable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import test_deepseek_v4

    folder = tmp_path_factory.mktemp("v4-fp8")
    overrides = {"index_topk": 32, "num_experts_per_tok": 8, "index_head_dim": 32}
    test_deepseek_v4.GPU_CONFIGS["v4-kv"] = (overrides, "hf")
    try:
        test_deepseek_v4.build("v4-kv", folder)
    finally:
        del test_deepseek_v4.GPU_CONFIGS["v4-kv"]
    return folder


@pytest.mark.parametrize(("model", "kv_dtype"), [("v41", "fp8"), ("v41", "fp4"), ("v4", "fp8")])
def test_logits_stay_near_the_exact_cache(tmp_path, request, model, kv_dtype):
    """Prefill and cached decode logits over the quantized cache against the float32 cache's, on every step
    whose prefix is the same in both runs (module docstring: tolerances and measured values)."""
    if model == "v41":
        build_v41(tmp_path, **STABLE)
        folder = tmp_path
    else:
        folder = request.getfixturevalue("v4_stable")
    runs = {s: _step_logits(make_llm(folder, max_model_len=256, max_num_batched_tokens=32, cache={"kv_dtype": s}))
            for s in ("auto", kv_dtype)}
    errors, equal, steps = [], 0, 0
    for exact, quantized in zip(runs["auto"], runs[kv_dtype], strict=True):
        for a, b in zip(exact, quantized, strict=True):
            errors.append(((b - a).abs().max() / a.abs().max()).item())
            steps += 1
            if a.argmax() != b.argmax():
                break
            equal += 1
    assert max(errors) <= STEP_TOLERANCE and statistics.median(errors) <= MEDIAN_TOLERANCE, sorted(errors)
    assert equal / steps >= MIN_AGREEMENT, (equal, steps)


# --------------------------------------------------------------------------------------------- errors


def test_unsupported_settings_fail_at_start_up_naming_them(tmp_path, v4_stable):
    """A model whose caches cannot store a format names ``cache.kv_dtype`` and the values it allows; a width
    that is not a multiple of a format's scale group names the format; an unknown value lists them all."""
    from deepinfer import LLM

    llama = save_tiny("llama", tmp_path / "llama")[1]
    with pytest.raises(ConfigError, match=r"cache\.kv_dtype='fp4'.*PagedKVSpec.*allowed values for this model: "
                                          r"'auto', 'bf16', 'fp8'"):
        LLM(llama, kv_cache_bytes=1 << 20, block_size=8, dtype="float32", device="cpu", kv_dtype="fp4")
    with pytest.raises(ConfigError, match=r"cache\.kv_dtype='fp4'.*HybridLayerSpec.*allowed values for this "
                                          r"model: 'auto', 'fp8'$"):
        make_llm(v4_stable, max_model_len=256, cache={"kv_dtype": "fp4"})
    build_v41(tmp_path / "v41")  # index_head_dim 16: below FP4_INDEX's 32-value group
    with pytest.raises(ConfigError, match=r"cache\.kv_dtype='fp8': fp4_index: 16 values a token"):
        v41_llm(tmp_path / "v41", cache={"kv_dtype": "fp8"})
    with pytest.raises(ValueError, match=r"cache\.kv_dtype='fp16': allowed values are 'auto', 'bf16', 'fp8', 'fp4'"):
        fp8.kv_storage_dtype("fp16", torch.float32)
