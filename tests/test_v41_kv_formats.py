"""V4.1's quantized KV layouts (``deepinfer/kv/v41_formats.py``): byte sizes as the reference states them,
round trips that land on the nearest representable value under the written scale, and paged blocks."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv.v41_formats import FP4_INDEX, FP4_MAIN, MXFP8, V41_KV_FORMATS
from deepinfer.model.layers import fp4


def sample(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Rows of mixed magnitudes (1e-3 .. 1e2), one all-zero row, as bf16 KV entries are."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen) * torch.logspace(-3, 2, n).unsqueeze(1)
    x[n // 2] = 0
    return x.bfloat16().float()


def test_bytes_per_token_are_the_references():
    assert (MXFP8.bytes_per_token, FP4_MAIN.bytes_per_token, FP4_INDEX.bytes_per_token) == (528, 288, 68)
    assert set(V41_KV_FORMATS) == {"mxfp8", "fp4", "fp4_index"}
    # lcm(32, 528) = 1056 and lcm(32, 288) = 288; block-wide sections align to 32
    assert MXFP8.block_stride(64) == 64 * 528 and MXFP8.block_stride(3) == 2112
    assert FP4_MAIN.block_stride(133) == 133 * 288 and FP4_INDEX.block_stride(3) == 224


@pytest.mark.parametrize("fmt", [FP4_MAIN, FP4_INDEX], ids=lambda f: f.name)
def test_fp4_round_trip_lands_on_the_nearest_point_of_its_scale(fmt):
    """Each decoded value is a nearest point (float64) of ±E2M1 × the token group's written scale; e4m3
    scales are ``amax/6`` rounded to nearest, ue8m0 the power of two that keeps amax within 6."""
    x = sample(16, fmt.elements)
    data, scales = fmt.encode(x)
    assert data.shape == (16, fmt.data_bytes) and scales.shape == (16, fmt.scale_bytes)
    back = fmt.decode(data, scales, torch.float64)
    s = fp4.scale_values(scales, fmt.scales).double()
    grid = torch.tensor(fp4.E2M1_VALUES, dtype=torch.float64)
    points = s.repeat_interleave(fmt.per_scale, dim=-1).unsqueeze(-1) * grid
    nearest = (points - x.double().unsqueeze(-1)).abs().min(-1).values
    assert torch.equal((back - x.double()).abs(), nearest)
    amax = x.double().unflatten(-1, (-1, fmt.per_scale)).abs().amax(-1)
    if fmt.scales == "e4m3":
        want = (amax / 6).clamp_min(2.0 ** -9).float().to(torch.float8_e4m3fn).double()
        assert torch.equal(s, want)
    else:
        assert (amax <= 6 * s).all() and ((amax > 3 * s) | (amax == 0)).all()
    # relative error of each group's largest value (groups above the e4m3 floor's reach, amax ≥ 0.1):
    # a ue8m0 scale leaves amax/scale in (3, 6], the worst point 5 between 4 and 6 (1/5); a nearest e4m3
    # scale leaves it within 6·(1 ± 1/16) of 6, which rounds to 6 (at most 1/15 off)
    grouped = x.abs().unflatten(-1, (-1, fmt.per_scale)).amax(-1).repeat_interleave(fmt.per_scale, -1)
    top = (x.abs() == grouped) & (grouped >= 0.1)
    rel = ((back - x.double()).abs() / x.double().abs())[top]
    assert rel.numel() >= 16 and rel.max() <= (1 / 15 if fmt.scales == "e4m3" else 1 / 5)


def test_mxfp8_round_trip_is_e4m3_under_a_power_of_two_scale():
    x = sample(16, 512, seed=1)
    data, scales = MXFP8.encode(x)
    back = MXFP8.decode(data, scales, torch.float64)
    s = fp4.ue8m0_values(scales).double()
    amax = x.double().unflatten(-1, (-1, 32)).abs().amax(-1)
    assert (amax <= 448 * s).all() and ((amax > 224 * s) | (amax < 1e-4)).all()
    expect = (x.double() / s.repeat_interleave(32, -1)).float().to(torch.float8_e4m3fn).double()
    assert torch.equal(back, expect * s.repeat_interleave(32, -1))
    rel = ((back - x.double()).abs() / x.double().abs().clamp_min(1e-30))[x.abs() > 1e-2]
    assert rel.max() <= 2.0 ** -4  # three mantissa bits, round to nearest


@pytest.mark.parametrize("fmt", [MXFP8, FP4_MAIN, FP4_INDEX], ids=lambda f: f.name)
def test_paged_block_layout_and_round_trip(fmt):
    """A block of 5 tokens written 3 at a time; interleaved formats put each token's scales right after its
    data, the index format every token's data first, then every token's scales."""
    size, x = 5, sample(5, fmt.elements, seed=2)
    block = torch.zeros(fmt.block_stride(size), dtype=torch.uint8)
    fmt.write_block(block, x[:3], size)
    data, scales = fmt.encode(x[:3])
    if fmt.interleaved:
        t = fmt.bytes_per_token
        assert torch.equal(block[t: t + fmt.data_bytes], data[1]) and torch.equal(block[t + fmt.data_bytes: 2 * t],
                                                                                  scales[1])
    else:
        assert torch.equal(block[fmt.data_bytes: 2 * fmt.data_bytes], data[1])
        start = size * fmt.data_bytes + fmt.scale_bytes
        assert torch.equal(block[start: start + fmt.scale_bytes], scales[1])
    assert torch.equal(fmt.read_block(block, 3, size), fmt.decode(data, scales))
    with pytest.raises(ValueError, match=fmt.name):
        fmt.read_block(block, 6, size)
    with pytest.raises(ValueError, match=f"{fmt.elements} values"):
        fmt.encode(torch.zeros(2, fmt.elements + 32))


@pytest.mark.parametrize(("fmt", "tolerance"), [(FP4_MAIN, 0.16), (MXFP8, 0.045)], ids=["fp4", "mxfp8"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_over_stored_entries_is_within_tolerance_of_bf16(fmt, tolerance, seed):
    """V4.1's shared-KV attention (the 512-d entry is key and value) of 8 query heads over 64 entries read
    back from the format, against the bf16 entries: relative Frobenius error of the output within
    ``tolerance`` (measured 0.12–0.13 for FP4, 0.034–0.036 for MXFP8 on N(0, 1) entries)."""
    gen = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(8, 512, generator=gen), torch.randn(64, 512, generator=gen).bfloat16().float()

    def attend(entries: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ entries.T / 512 ** 0.5, dim=-1) @ entries

    size = 64
    block = torch.zeros(fmt.block_stride(size), dtype=torch.uint8)
    fmt.write_block(block, kv, size)
    want = attend(kv)
    err = (attend(fmt.read_block(block, size, size)) - want).norm() / want.norm()
    assert 0 < err <= tolerance
