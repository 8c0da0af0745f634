"""The e2m1 (FP4) codec of ``deepinfer/model/layers/fp4.py`` against tables derived here, in float64, from
the format definitions (OCP MX e2m1: sign, 2 exponent bits of bias 1, 1 mantissa bit; ue8m0: 2^(b-127),
255 NaN), every code under every scale."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.model.layers import fp4


def e2m1_definition(code: int) -> float:
    """The value of a 4-bit e2m1 code by the format definition."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -mag if sign else mag


def ue8m0_definition(byte: int) -> float:
    return math.nan if byte == 255 else math.ldexp(1.0, byte - 127)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal, NaN anywhere matching NaN (its payload is not part of the format)."""
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[got.dtype]
    return torch.equal(got[~nan].view(ints), want[~nan].view(ints))


def test_e2m1_table_is_the_format_definition():
    assert tuple(e2m1_definition(c) for c in range(16)) == fp4.E2M1_VALUES
    assert [math.copysign(1, v) for v in fp4.E2M1_VALUES[8:]] == [-1.0] * 8  # code 8 is -0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stored", [torch.uint8, torch.float8_e8m0fnu])
def test_dequantize_is_bit_exact_on_every_code_and_ue8m0_scale(dtype, stored):
    """Row b holds every code twice (32 values, one block) under scale byte b, for all 256 bytes."""
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1)
    want64 = torch.tensor([[e2m1_definition(int(c)) * ue8m0_definition(b) for c in codes[b]] for b in range(256)],
                          dtype=torch.float64)
    got = fp4.dequantize_e2m1(fp4.pack_e2m1(codes), scales.view(stored), block=32, dtype=dtype)
    assert got.shape == (256, 32)
    assert same_bits(got, want64.to(dtype))
    # the ends of the range: subnormal 2^-128 in float32, overflow to inf
    assert got[0, 1].item() == 2.0 ** -128 and math.isinf(got[254, 7].item()) and got[127, 7].item() == 6.0


def test_dequantize_is_bit_exact_on_every_e4m3_scale():
    """The per-16 e4m3 scales of the FP4 main-KV layout: every code under every e4m3 byte (float32)."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(256, 1)
    scale_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1)
    e4m3 = scale_bytes.view(torch.float8_e4m3fn).double()
    want64 = torch.tensor([[e2m1_definition(int(c)) for c in row] for row in codes], dtype=torch.float64) * e4m3
    got = fp4.dequantize_e2m1(fp4.pack_e2m1(codes), scale_bytes, block=16, fmt="e4m3", dtype=torch.float32)
    assert same_bits(got, want64.float())


def test_pack_puts_the_even_index_in_the_low_nibble_and_round_trips_every_byte():
    assert fp4.pack_e2m1(torch.tensor([1, 2, 15, 0])).tolist() == [0x21, 0x0F]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(fp4.pack_e2m1(fp4.unpack_e2m1(every)), every)
    assert torch.equal(fp4.unpack_e2m1(every.view(torch.int8)), fp4.unpack_e2m1(every))
    with pytest.raises(ValueError, match="even"):
        fp4.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize(("block", "fmt"), [(32, "ue8m0"), (16, "e4m3")])
def test_quantize_rounds_to_the_nearest_code_within_the_scale(block, fmt):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=gen) * torch.logspace(-3, 2, 8).unsqueeze(1)
    packed, scales = fp4.quantize_e2m1(x, block, fmt)
    back = fp4.dequantize_e2m1(packed, scales, block, fmt, dtype=torch.float64)
    s = fp4.scale_values(scales, fmt).double().repeat_interleave(block, dim=-1)
    # no block saturates (its scale maps amax to at most 6) and each value is the nearest grid point
    assert (x.double().abs() / s <= 6.0).all()
    grid = torch.tensor(fp4.E2M1_VALUES[:8], dtype=torch.float64)
    nearest = ((x.double().abs() / s).unsqueeze(-1) - grid).abs().min(dim=-1).values * s
    assert torch.allclose((back - x.double()).abs(), nearest, rtol=0, atol=1e-12)
    # representable values come back unchanged; ties go to the even code (0.25 → 0, 5 → 4, 2.5 → 2)
    again = fp4.quantize_e2m1(back.float(), block, fmt)
    assert torch.equal(fp4.dequantize_e2m1(*again, block, fmt, dtype=torch.float64), back)
    assert fp4.e2m1_codes(torch.tensor([0.25, 5.0, 2.5, -0.75])).tolist() == [0, 6, 4, 8 | 2]


def test_scales_of_the_wrong_shape_fail_naming_the_tensor():
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"layers\.0\.w1: scales of shape \(4, 3\)"):
        fp4.dequantize_e2m1(packed, torch.zeros(4, 3, dtype=torch.uint8), name="layers.0.w1")
    with pytest.raises(TypeError, match="one-byte"):
        fp4.dequantize_e2m1(packed, torch.zeros(4, 2, dtype=torch.float32))
