"""The ``flash_mla`` adapter on CPU with a fake ``flash_mla`` module (the real one needs an SM100 GPU): the
capability check, the FP8 token packing, the tensors handed to ``flash_mla_with_kvcache``, and the result
against the reference MLA backend. The fake computes what kernels.md §4 documents for the sparse path:
gather the tokens named by ``indices``, masked softmax, weighted sum."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_triton_attention import forward_context, make_batch


def unpack_fp8_tokens(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``flash_mla.pack_fp8_tokens`` up to e4m3 rounding: ``[..., 528]`` uint8 → ``[..., 512]``
    float32 (what FlashMLA reads back; the fake kernel and the round-trip test decode with it)."""
    from deepinfer_attention.flash_mla import SCALE_GROUP, TOKEN_DIMS

    values = packed[..., :TOKEN_DIMS].view(torch.float8_e4m3fn).float().unflatten(-1, (-1, SCALE_GROUP))
    scales = torch.exp2(packed[..., TOKEN_DIMS:].float() - 127)
    return (values * scales.unsqueeze(-1)).flatten(-2)


class FakeFlashMLA(types.ModuleType):
    """``get_mla_metadata`` and ``flash_mla_with_kvcache`` in torch; records each call's arguments."""

    def __init__(self) -> None:
        super().__init__("flash_mla")
        self.calls: list[dict] = []
        self.metadata_calls = 0

    def get_mla_metadata(self, *args: object, **kwargs: object) -> tuple[object, None]:
        self.metadata_calls += 1
        return object(), None

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                               cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: object,
                               num_splits: object = None, *, softmax_scale: float, causal: bool,
                               is_fp8_kvcache: bool, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append({"q": q, "k_cache": k_cache, "block_table": block_table, "cache_seqlens": cache_seqlens,
                           "head_dim_v": head_dim_v, "metadata": tile_scheduler_metadata, "scale": softmax_scale,
                           "causal": causal, "fp8": is_fp8_kvcache, "indices": indices})
        tokens = unpack_fp8_tokens(k_cache.flatten(0, 2))  # [slots, 512]
        keys = tokens[indices.clamp_min(0).long()]  # [B, s_q, topk, 512]
        scores = torch.einsum("bshd,bskd->bshk", q.float(), keys) * softmax_scale
        scores = scores.masked_fill((indices < 0).unsqueeze(2), float("-inf"))
        weights = scores.softmax(-1)
        out = torch.einsum("bshk,bskd->bshd", weights, keys[..., :head_dim_v])
        return out.to(q.dtype), torch.logsumexp(scores, -1).transpose(1, 2)


@pytest.fixture
def fake_flash_mla(monkeypatch: pytest.MonkeyPatch) -> FakeFlashMLA:
    module = FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    return module


def test_capability_check_takes_only_sm100_with_flash_mla(monkeypatch: pytest.MonkeyPatch,
                                                          fake_flash_mla: FakeFlashMLA) -> None:
    from deepinfer_attention.flash_mla import FlashMLABackend

    backend = FlashMLABackend()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, usable in [((9, 0), False), ((8, 0), False), ((12, 0), False), ((10, 0), True), ((10, 3), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_, c=capability: c)
        assert backend.available() is usable, capability
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # not installed: the import fails
    assert not backend.available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not backend.available()
    assert backend.ops == {"mla_attention"} and backend.capabilities.devices == {"cuda"}


def test_the_plugin_offers_it_below_triton_mla() -> None:
    from deepinfer_attention.config import AttentionConfig
    from deepinfer_attention.plugin import Plugin

    backends = {b.name: b for b in Plugin(AttentionConfig()).deepinfer_attention_backends()}
    assert backends["flash_mla"].priority < 20  # triton_mla on a GPU


def test_fp8_token_packing_round_trips() -> None:
    from deepinfer_attention.flash_mla import pack_fp8_tokens

    rows = torch.randn(3, 5, 512, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 512)
    packed = pack_fp8_tokens(rows.bfloat16())
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 528)
    x = rows.bfloat16().float()
    scale = torch.exp2(packed[..., 512:].float() - 127).repeat_interleave(32, dim=-1)  # one per 32 values
    assert (x.abs() <= 448 * scale).all()
    # e4m3 rounding: half an ulp (2^-4 relative) for normals, half the subnormal step 2^-9 below them.
    assert ((unpack_fp8_tokens(packed) - x).abs() <= 2 ** -4 * x.abs() + 2 ** -10 * scale).all()


def _mla_inputs(batch, heads: int, latent_dim: int, rope: int, gen: torch.Generator) -> dict:
    tokens, nope, v_dim = len(batch.positions), 16, 16
    cache = torch.randn(batch.num_blocks, batch.block_size, latent_dim + rope, generator=gen).bfloat16()
    return {"q_nope": (0.1 * torch.randn(tokens, heads, nope, generator=gen)).bfloat16(),
            "q_pe": (0.1 * torch.randn(tokens, heads, rope, generator=gen)).bfloat16(),
            "latent": torch.randn(tokens, latent_dim, generator=gen).bfloat16(),
            "k_pe": torch.randn(tokens, rope, generator=gen).bfloat16(),
            "cache": (cache,),
            "kv_b_weight": (0.05 * torch.randn(heads * (nope + v_dim), latent_dim, generator=gen)).bfloat16()}


@pytest.mark.parametrize("rows", [([12, 7, 20], [1, 1, 1]), ([12, 7, 20, 30], [1, 3, 2, 9])],
                         ids=["decode", "mixed"])
def test_adapter_passes_flash_mla_its_layout(rows: tuple, fake_flash_mla: FakeFlashMLA) -> None:
    from deepinfer_attention.flash_mla import FlashMLABackend

    from deepinfer.ops import TorchMLABackend

    gen = torch.Generator().manual_seed(7)
    batch = make_batch(*rows, 4, gen)
    ctx = forward_context(batch)
    heads, latent_dim, rope = 3, 448, 64
    args = _mla_inputs(batch, heads, latent_dim, rope, gen)
    reference_cache = (args["cache"][0].clone(),)
    expected = TorchMLABackend().mla_attention(**{**args, "cache": reference_cache}, ctx=ctx, scale=0.1)
    backend = FlashMLABackend(max_query_len=4)
    out = backend.mla_attention(**args, ctx=ctx, scale=0.1)
    out_again = backend.mla_attention(**args, ctx=ctx, scale=0.1)  # a second layer of the same step

    torch.testing.assert_close(args["cache"][0], reference_cache[0], atol=0, rtol=0)
    torch.testing.assert_close(out, out_again, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expected.float(), atol=0.03, rtol=0.1)  # FP8 keys and values
    assert fake_flash_mla.metadata_calls == 1 and len(fake_flash_mla.calls) == 2
    call = fake_flash_mla.calls[0]
    short = sum(1 for n in batch.query_lens if n <= 4)
    n = sum(batch.query_lens[:short])
    width = batch.block_tables.shape[1]
    assert call["q"].shape == (n, 1, 64, 512) and call["q"].dtype == torch.bfloat16
    assert not call["q"][:, :, heads:].any()  # padded heads are zeros
    assert call["k_cache"].shape == (len(batch.seq_lens) * width, 4, 1, 528) and call["k_cache"].dtype == torch.uint8
    assert call["indices"].dtype == torch.int32 and call["indices"].shape[:2] == (n, 1)
    assert call["indices"].shape[2] % 64 == 0 and call["indices"].shape[2] >= width * 4
    visible = (call["indices"][:, 0] >= 0).sum(-1)
    torch.testing.assert_close(visible, batch.positions[:n] + 1, check_dtype=False)
    assert call["head_dim_v"] == 512 and call["scale"] == 0.1 and not call["causal"] and call["fp8"]


def test_unsupported_layouts_are_refused(fake_flash_mla: FakeFlashMLA) -> None:
    from deepinfer_attention.flash_mla import FlashMLABackend

    batch = make_batch([5, 9], [1, 1], 4, torch.Generator().manual_seed(0))
    ctx = forward_context(batch)
    v3 = _mla_inputs(batch, 2, 512, 64, torch.Generator().manual_seed(1))  # DeepSeek-V2/V3: 576-dim rows
    with pytest.raises(ValueError, match=r"576 dims.*triton_mla"):
        FlashMLABackend().mla_attention(**v3, ctx=ctx, scale=0.1)
    fp32 = {k: (v[0].float(),) if k == "cache" else v.float() for k, v in
            _mla_inputs(batch, 2, 448, 64, torch.Generator().manual_seed(1)).items()}
    with pytest.raises(ValueError, match="bfloat16"):
        FlashMLABackend().mla_attention(**fp32, ctx=ctx, scale=0.1)
    assert not fake_flash_mla.calls
