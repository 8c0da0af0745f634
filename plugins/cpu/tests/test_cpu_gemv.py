"""The few-row float32 / bf16 kernel (``gemv.py``) against a float64 product, each row bitwise the same alone or
beside others, and the ``onednn`` backend's use of it."""

from __future__ import annotations

import pytest
import torch
from cpu_flags import cpu_has
from deepinfer_cpu import gemv as gemv_module
from deepinfer_cpu.gemv import bf16_kernel, fits, gemv
from deepinfer_cpu.onednn import OneDNNGemmBackend, onednn_available


@pytest.mark.parametrize(("n", "k"), [(1, 16), (5, 7), (192, 576), (1537, 576), (64, 1541)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_equals_a_float64_product(n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(1, 1, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    assert fits(x, w)
    got = gemv(x, w, bias)
    want = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    assert got.shape == (1, 1, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "k"), [(5, 7), (192, 576), (1537, 576), (2048, 64)])
def test_bfloat16_gemv_sums_the_bf16_values_in_float32(n: int, k: int) -> None:
    """bf16 row and weight: the float64 product of their bf16 values, rounded to bf16 once."""
    gen = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    assert fits(x, w)
    got = gemv(x, w, bias)
    want = x.double() @ w.double().t() + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    # one bf16 rounding of a float32 sum: within half a bf16 step (2^-8 relative) plus float32 noise
    assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-4).all()
    strided = torch.randn(k, 2, generator=gen).bfloat16()[:, 0].unsqueeze(0)  # one row with a stride of 2
    assert not strided.is_contiguous() and fits(strided, w)
    assert torch.equal(gemv(strided, w), gemv(strided.contiguous(), w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(5, 7), (96, 576), (33, 1541), (64, 1536)])
def test_each_row_is_bitwise_the_same_alone_or_beside_others(dtype: torch.dtype, n: int, k: int) -> None:
    """1–19 rows in one call (past the kernel's 8 rows per weight pass): every row equals its one-row call bit
    for bit, so a verification step's rows equal decode steps'; the rows match a float64 product."""
    gen = torch.Generator().manual_seed(n + k)
    w, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
    x = torch.randn(19, k, generator=gen).to(dtype)
    alone = torch.cat([gemv(x[i:i + 1], w, bias) for i in range(19)])
    for rows in (2, 3, 8, 9, 19):
        assert fits(x[:rows], w)
        got = gemv(x[:rows], w, bias)
        assert got.shape == (rows, n) and got.dtype == dtype
        assert torch.equal(got, alone[:rows])
    want = x.double() @ w.double().t() + bias.double()
    bound = want.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 1e-5) + 1e-4
    assert ((alone.double() - want).abs() <= bound).all()


def test_amx_serves_bf16_weights_of_whole_tiles_where_the_cpu_has_it() -> None:
    """With AMX-BF16 (``-march=native`` on such a CPU) weights whose sides are multiples of 32 go through the
    tiles and the others through ``vdpbf16ps``; the shapes above then run both."""
    if cpu_has("amx_bf16"):
        assert bf16_kernel(96, 576) == bf16_kernel(49152, 576) == "amx"
        assert bf16_kernel(33, 1541) == bf16_kernel(96, 577) == bf16_kernel(80, 576) == "avx512_bf16"
    else:
        assert bf16_kernel(96, 576) == ("avx512_bf16" if cpu_has("avx512_bf16") else "widen")


def test_what_gemv_does_not_serve() -> None:
    w = torch.randn(8, 16)
    assert fits(torch.randn(2, 16), w)  # rows
    assert not fits(torch.randn(1, 16), w.t().contiguous().t())  # column-major
    assert not fits(torch.randn(1, 16), w.bfloat16())  # mixed dtypes
    assert not fits(torch.randn(1, 16).half(), w.half())
    assert not fits(torch.randn(1, 15), w)  # another K


@pytest.mark.skipif(not onednn_available(), reason="needs torch's oneDNN ops")
def test_the_backend_sends_calls_of_fewer_than_min_rows_to_gemv_and_keeps_weights_row_major(monkeypatch) -> None:
    backend = OneDNNGemmBackend()
    assert backend.min_rows_for(torch.float32) == 13 and backend.decode_stack.max_rows(torch.float32) == 12
    # bfloat16 on AMX: the tiles take up to 32 rows in one pass, so the GEMV and the fused step serve 32
    bf16_rows = 33 if cpu_has("amx_bf16") else 7
    assert backend.min_rows_for(torch.bfloat16) == bf16_rows
    assert backend.decode_stack.max_rows(torch.bfloat16) == bf16_rows - 1
    assert OneDNNGemmBackend(min_rows=3).min_rows_for(torch.bfloat16) == 3  # set: every dtype
    weight = torch.nn.Parameter(torch.randn(40, 24), requires_grad=False)
    plain = backend.prepare_weight(weight)
    assert plain.is_contiguous()
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr("deepinfer_cpu.onednn.gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    param = torch.nn.Parameter(plain, requires_grad=False)
    for rows in (1, 3, 12, 13, 20):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(backend.linear(x, param), x @ plain.t(), rtol=1e-5, atol=1e-5)
    assert calls == [1, 3, 12]  # 13 and 20 rows: oneDNN on the packed copy


@pytest.mark.parametrize("march", ["native", pytest.param("skylake-avx512", marks=pytest.mark.skipif(
    not cpu_has("avx512bw"), reason="the AVX-512 build runs only on a CPU with AVX-512")), "x86-64-v2"])
def test_each_bf16_kernel_sums_the_bf16_values_and_rows_alone_or_together_alike(march: str) -> None:
    """The bf16 kernel of every build (``native``: ``vdpbf16ps`` where the CPU has AVX512-BF16; AVX-512 without it and
    no AVX-512: the widening kernel), called directly: within float32 rounding of the float64 product of the bf16
    values, and 1–9 rows in one call bitwise the rows alone."""
    import ctypes

    from deepinfer_cpu.cbuild import build_library

    lib = build_library(gemv_module.SOURCE, march=march)
    kernel = lib.gemv_bf16
    kernel.restype = None
    kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 1541  # K: whole chain groups, whole 32-weight vectors past them and a tail
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(9, k, generator=gen).bfloat16().float()

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        kernel(rows.data_ptr(), w.data_ptr(), None, out.data_ptr(), rows.shape[0], n, k, 2)
        return out

    alone = torch.cat([run(x[i:i + 1].contiguous()) for i in range(9)])
    assert torch.equal(run(x), alone)
    want = x.double() @ w.double().t()
    torch.testing.assert_close(alone.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "k"), [(96, 576), (70, 1541)])  # AMX where the CPU has it; vdpbf16ps / widening
def test_float32_rows_against_a_bf16_weight_are_rounded_as_torch_rounds_them(n: int, k: int) -> None:
    """The kernel's float32 rows, rounded to bfloat16 on their way in (vectorized on the AMX path), give bitwise the
    result of rows that torch rounded first: ties to even either way, infinities kept, a NaN row all NaN."""
    if bf16_kernel(n, k) == "widen":
        pytest.skip("the widening kernel sums the float32 rows unrounded")
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    rounded = torch.randn(4, k, generator=gen).bfloat16()
    halfway = (rounded.view(torch.int16).int() << 16 | 0x8000).view(torch.float32)  # exactly between two bf16s
    x = torch.cat([torch.randn(3, k, generator=gen), halfway[:2], rounded[2:].float()])
    x[5, 7], x[5, 9], x[4, 3] = float("inf"), float("-inf"), float("nan")
    kernel = gemv_module._kernels()[True]

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        kernel(rows.data_ptr(), w.data_ptr(), None, out.data_ptr(), rows.shape[0], n, k, 1)
        return out

    got, want = run(x.contiguous()), run(x.bfloat16().float().contiguous())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # bitwise, NaN where the other has NaN
    assert got[4].isnan().all() and got[5].isinf().any() and not got[:4].isnan().any()
