"""The FP8 KV cache (``cache.kv_dtype: fp8``, ``deepinfer/kv/fp8.py``): the format's error bounds, the block
budget it buys, and tiny Llama / DeepSeek-V3 engines on the torch reference backends that read it.

Logits of an FP8-cache run are compared with the model-dtype-cache run (float32 here) on every step whose
prefix is still the same in both runs (greedy tokens may part once the cache error flips an argmax); the
tolerance is a fraction of the step's max |logit| (``LOGIT_TOLERANCE``, with the measured values).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import record_logits, save_tiny

from deepinfer.errors import ConfigError
from deepinfer.interfaces import RunRequirements
from deepinfer.kv import fp8
from deepinfer.kv.pools import check_kv_dtype
from deepinfer.kv.specs import PagedKVSpec, PagedLatentSpec

# Max |Δ logit| / max |logit| between the FP8-cache and the float32-cache runs on one step (measured: Llama
# median 0.060, max 0.088; DeepSeek-V3 median 0.045, max 0.093 but for one step at 0.44, most likely a MoE
# top-k choice flipped by the perturbed hidden state); a bf16 cache is held to 0.01 (measured ≤ 0.006).
# e4m3 keeps 3 mantissa bits against bf16's 7: ~16× bf16's error is what the format gives on these models.
LOGIT_TOLERANCE = {"bf16": 0.01, "fp8": 0.15}
MOE_FLIP_TOLERANCE = 0.5  # DeepSeek-V3: a step where routing flips
PROMPTS = [[5, 9, 77, 3], list(range(10, 33)), [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
ENGINE = {"kv_cache_bytes": 1 << 20, "block_size": 8, "dtype": "float32", "device": "cpu"}


# ------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [80, 128])
def test_round_trip_is_within_half_an_e4m3_step(dtype: torch.dtype, dim: int) -> None:
    """Groups of widely different magnitudes (and an all-zero one), ``dim`` 80 with a short last group:
    scales are exact powers of two, every scaled group fits e4m3 without saturating, and each element
    reads back within half a step: 2^-4·|x| in e4m3's normal range, 2^-10·scale below it — inside the
    2^-3 relative step of the format."""
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(64, 3, dim, generator=gen) * torch.logspace(-6, 6, 64).view(64, 1, 1)
    x[0, 0] = 0.0
    x = x.to(dtype)
    data, scales = fp8.quantize(x)
    assert data.dtype == fp8.FP8_DTYPE and data.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (64, 3, fp8.num_groups(dim))
    scale = fp8.scale_values(scales)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    per_element = scale.repeat_interleave(fp8.GROUP, dim=-1)[..., :dim]
    xf = x.float()
    scaled = xf.abs() / per_element
    assert scaled.max() <= fp8.FP8_MAX
    amax = torch.nn.functional.pad(xf.abs(), (0, fp8.num_groups(dim) * fp8.GROUP - dim)).unflatten(
        -1, (-1, fp8.GROUP)).amax(-1)
    nonzero = amax > 0
    assert torch.all(amax[nonzero] / scale[nonzero] > fp8.FP8_MAX / 2)  # the smallest scale that fits
    back = fp8.dequantize(data, scales, torch.float32)
    err = (back - xf).abs()
    normal = scaled >= 2.0 ** -6
    assert torch.all(err[normal] <= 2.0 ** -4 * xf.abs()[normal])
    assert torch.all(err[~normal] <= 2.0 ** -10 * per_element[~normal])
    assert torch.all(err[normal] <= 2.0 ** -3 * xf.abs()[normal])
    assert torch.all(back[0, 0] == 0)
    assert torch.equal(fp8.roundtrip(x), back.to(dtype))


def test_store_and_gather_through_a_block_table() -> None:
    """``store`` writes rows at flat slots; ``gather`` reads blocks back, dequantized, in table order."""
    gen = torch.Generator().manual_seed(3)
    data = torch.zeros(5, 4, 2, 40, dtype=fp8.FP8_DTYPE)
    scales = torch.zeros(5, 4, 2, 2, dtype=torch.uint8)
    rows = torch.randn(8, 2, 40, generator=gen)
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7])  # block 3, then block 1
    fp8.store(data, scales, slots, rows)
    got = fp8.gather(data, scales, torch.tensor([[3, 1]]), torch.float32)
    assert got.shape == (1, 8, 2, 40)
    assert torch.equal(got[0], fp8.roundtrip(rows))


# -------------------------------------------------------------------------------------- specs, budget


def test_specs_count_the_scale_bytes() -> None:
    gqa, mla = PagedKVSpec(8, 128), PagedLatentSpec(512, 64)
    assert gqa.bytes_per_block(128, torch.bfloat16) == 2 * 128 * 8 * 128 * 2
    assert gqa.bytes_per_block(128, fp8.FP8_DTYPE) == 2 * 128 * 8 * (128 + 4)  # 1.94× the tokens of bf16
    assert mla.bytes_per_block(128, fp8.FP8_DTYPE) == 128 * (576 + 18)  # the reference's 16 + 2 scale bytes
    k, v, k_scales, v_scales = gqa.allocate(3, 16, fp8.FP8_DTYPE, torch.device("cpu"))
    assert k.dtype == v.dtype == fp8.FP8_DTYPE and k.shape == (3, 16, 8, 128)
    assert k_scales.dtype == v_scales.dtype == torch.uint8 and k_scales.shape == (3, 16, 8, 4)
    rows, row_scales = PagedLatentSpec(16, 8).allocate(3, 16, fp8.FP8_DTYPE, torch.device("cpu"))
    assert rows.shape == (3, 16, 24) and row_scales.shape == (3, 16, 2)  # latent and rope key: own groups
    assert len(gqa.allocate(3, 16, torch.bfloat16, torch.device("cpu"))) == 2


def test_kv_dtype_settings() -> None:
    assert fp8.kv_storage_dtype("auto", torch.float32) == torch.float32
    assert fp8.kv_storage_dtype("bf16", torch.float32) == torch.bfloat16
    assert fp8.kv_storage_dtype("fp8", torch.bfloat16) == fp8.FP8_DTYPE
    assert fp8.kv_storage_dtype("fp4", torch.float32) == fp8.FP4_KV_DTYPE  # V4.1's layouts (kv/v41_cache.py)
    with pytest.raises(ValueError, match=r"cache\.kv_dtype='fp16': allowed values are 'auto', 'bf16', 'fp8', 'fp4'"):
        fp8.kv_storage_dtype("fp16", torch.float32)


def test_each_cache_kind_names_the_kv_dtypes_it_stores() -> None:
    """GQA and MLA rows store bf16 and fp8; DeepSeek-V4's hybrid caches fp8 (V4.1's also fp4, in V4.1's layouts:
    tests/test_v41_kv_cache.py), not bf16 on a float32 model; the V4 reference backend reads fp8 and fp4."""
    from deepinfer.kv.state import HybridLayerSpec
    from deepinfer.model.layers.reference_deepseek_v4 import TorchSinkAttentionBackend

    v4 = HybridLayerSpec(paged=(), rings=(), kind="sliding", window=128, kv_dtypes=("fp8",))
    with pytest.raises(ConfigError, match=r"cache\.kv_dtype='bf16': the model's caches \(HybridLayerSpec, "
                                          r"PagedKVSpec\) do not store it; allowed values for this model: "
                                          r"'auto', 'fp8'"):
        check_kv_dtype([PagedKVSpec(2, 16), v4], torch.bfloat16, torch.float32, "bf16")
    check_kv_dtype([PagedKVSpec(2, 16), v4], fp8.FP8_DTYPE, torch.bfloat16, "fp8")
    check_kv_dtype([PagedKVSpec(2, 16), PagedLatentSpec(16, 8)], fp8.FP8_DTYPE, torch.bfloat16, "fp8")
    with pytest.raises(ConfigError, match=r"cache\.kv_dtype='fp4'.*allowed values for this model: "
                                          r"'auto', 'bf16', 'fp8'"):
        check_kv_dtype([PagedLatentSpec(16, 8)], fp8.FP4_KV_DTYPE, torch.bfloat16, "fp4")
    req = RunRequirements(device="cpu", dtype=torch.float32, kv_dtype="fp8", graph_safe=False, batch_invariant=False)
    assert req.missing(TorchSinkAttentionBackend.capabilities) == []


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_batch_invariant_runs_refuse_another_kv_dtype(tiny_llama_dir: Path, kv_dtype: str) -> None:
    """The batch-invariant backends read the model dtype only (float32 here)."""
    from deepinfer import LLM

    with pytest.raises(ConfigError, match=rf"paged_attention.*kv_dtype='{kv_dtype}'"):
        LLM(tiny_llama_dir, **ENGINE, kv_dtype=kv_dtype, kernels={"batch_invariant": True})


# ------------------------------------------------------------------------------------------- engines


def _run(folder: Path, kv_dtype: str) -> tuple[list[list[int]], dict[str, list[torch.Tensor]], int]:
    """Greedy tokens, per-request step logits and the pool's block count of one run; checks no block leaks."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(folder, **ENGINE, kv_dtype=kv_dtype)
    steps = record_logits(llm)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    per_request: dict[str, list[torch.Tensor]] = {}
    for ids, logits in steps:
        for rid, row in zip(ids, logits, strict=True):
            per_request.setdefault(rid, []).append(row)
    num_blocks = llm.engine.pool.num_blocks
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [per_request[o.request_id] for o in outs], num_blocks


def _step_errors(ref: tuple, run: tuple) -> list[float]:
    """Per comparable step (same prefix in both runs): max |Δ logit| / max |logit|."""
    errors = []
    for ref_tokens, ref_rows, tokens, rows in zip(ref[0], ref[1], run[0], run[1], strict=True):
        for j, (a, b) in enumerate(zip(ref_rows, rows, strict=True)):
            errors.append(((b - a).abs().max() / a.abs().max()).item())
            if tokens[j] != ref_tokens[j]:
                break
    return errors


@pytest.fixture(scope="module")
def tiny_v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_deepseek import save_tiny_v3

    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3"))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_fp8_cache_generates_near_the_exact_cache(model: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``kv_dtype`` auto (float32), bf16 and fp8 on the torch reference backends: the same budget holds
    the blocks the formats' bytes allow (fp8 ≈ 1.9× bf16 at these head widths), logits stay within
    ``LOGIT_TOLERANCE`` of the float32 cache's, and no block leaks."""
    if model == "llama":
        folder = save_tiny("llama", tmp_path / "tiny")[1]
        spec = PagedKVSpec(2, 16)
    else:
        folder = request.getfixturevalue("tiny_v3_dir")
        spec = PagedLatentSpec(16, 8)
    runs = {kv_dtype: _run(folder, kv_dtype) for kv_dtype in ("auto", "bf16", "fp8")}
    blocks = {kv_dtype: run[2] for kv_dtype, run in runs.items()}
    bytes_ratio = spec.bytes_per_block(8, torch.bfloat16) / spec.bytes_per_block(8, fp8.FP8_DTYPE)
    assert blocks["fp8"] / blocks["bf16"] == pytest.approx(bytes_ratio, rel=0.01)
    assert 1.7 < bytes_ratio < 2
    assert blocks["bf16"] == pytest.approx(2 * blocks["auto"], rel=0.01)
    for kv_dtype in ("bf16", "fp8"):
        errors = _step_errors(runs["auto"], runs[kv_dtype])
        assert len(errors) >= len(PROMPTS) * 2
        flips = [e for e in errors if e > LOGIT_TOLERANCE[kv_dtype]]
        allowed = 1 if model == "deepseek_v3" and kv_dtype == "fp8" else 0
        assert len(flips) <= allowed and all(e <= MOE_FLIP_TOLERANCE for e in flips), errors
