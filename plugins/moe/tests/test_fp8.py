"""FP8 block quantization (``fp8.py``) and the core's FP8-checkpoint dequantization."""

from __future__ import annotations

import pytest
import torch
from deepinfer_moe.fp8 import (
    FP8_MAX,
    Fp8Experts,
    dequantize_weight_blocks,
    quantize_rows,
    quantize_weight_blocks,
)
from moe_cases import dequantize_rows

from deepinfer.model.deepseek_v3 import dequantize_fp8_checkpoint


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 100, 70), (1, 128, 128)])
def test_block_quantization_round_trips_within_e4m3_precision(shape: tuple[int, ...]) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_weight_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.shape == (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    back = dequantize_weight_blocks(q, scale)
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 of each value's magnitude
    # (plus the subnormal floor, a few scale units).
    assert torch.all((back - w).abs() <= w.abs() * 2 ** -4 + scale.max() * 2 ** -9)
    assert q.float().abs().amax() == FP8_MAX  # every tile uses the full range (here: the largest tile)


def test_row_quantization_round_trips_and_pow2_scales_are_powers_of_two() -> None:
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 3
    for pow2 in (False, True):
        q, scale = quantize_rows(x, pow2=pow2)
        assert scale.shape == (5, 3)
        back = dequantize_rows(q, scale)
        assert torch.all((back - x).abs() <= x.abs() * 2 ** -4 + scale.repeat_interleave(128, 1)[:, :300] * 2 ** -9)
        if pow2:
            assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)


def test_requantizing_dequantized_bf16_weights_recovers_the_checkpoint_fp8_values() -> None:
    """A checkpoint stores FP8 + scales; the core dequantizes to bf16 at load; the FP8 backends quantize
    again with the same tiles and must get the checkpoint's bytes back (I % 128 == 0)."""
    gen = torch.Generator().manual_seed(2)
    w13 = torch.randn(2, 2 * 256, 384, generator=gen)
    w2 = torch.randn(2, 384, 256, generator=gen)
    original = Fp8Experts.quantize(w13, w2)
    bf16_13, bf16_2 = original.dequantize(torch.bfloat16)
    again = Fp8Experts.quantize(bf16_13, bf16_2)
    assert torch.equal(again.w13.view(torch.uint8), original.w13.view(torch.uint8))
    assert torch.equal(again.w2.view(torch.uint8), original.w2.view(torch.uint8))
    torch.testing.assert_close(again.w13_scale, original.w13_scale, rtol=2 ** -8, atol=0)


def test_fp8_checkpoint_pairs_are_dequantized_in_any_order_and_orphans_fail() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(200, 130, generator=gen), torch.randn(64, 64, generator=gen)
    qa, sa = quantize_weight_blocks(a)
    qb, sb = quantize_weight_blocks(b)
    plain = torch.randn(7)
    stream = [("x.a.weight_scale_inv", sa), ("x.norm.weight", plain), ("x.a.weight", qa),
              ("x.b.weight", qb), ("x.b.weight_scale_inv", sb)]
    out = dict(dequantize_fp8_checkpoint(stream, (128, 128)))
    assert set(out) == {"x.a.weight", "x.b.weight", "x.norm.weight"}
    torch.testing.assert_close(out["x.a.weight"], dequantize_weight_blocks(qa, sa), rtol=0, atol=0)
    torch.testing.assert_close(out["x.b.weight"], dequantize_weight_blocks(qb, sb), rtol=0, atol=0)
    assert out["x.norm.weight"] is plain
    with pytest.raises(ValueError, match=r"x\.c\.weight"):
        list(dequantize_fp8_checkpoint([("x.c.weight", qa)], (128, 128)))
