"""The fused router (``router_kernel.py``) against the torch reference ``deepinfer.model.layers.routing.route``:
ids equal as sets per row, weights within 1e-6, for V3's noaux_tc (bias, groups), V2's softmax
routings and the benchmark's balanced draw; ties go to the lower expert id. CPU through Triton's
interpreter; the ``gpu`` cases run the compiled kernel on CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deepinfer.interfaces import RoutingSpec
from deepinfer.model.layers.routing import route

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (experts, top_k, n_group, topk_group): V2-Lite, V3, and grouped shapes with E/G = 8 and 16.
SHAPES = [(64, 6, 1, 1), (256, 8, 8, 4), (64, 8, 8, 3), (64, 6, 4, 2)]
SPECS = {
    "noaux_tc": {"scoring": "sigmoid", "method": "noaux_tc", "normalize": True, "scaling": 2.5},
    "balanced": {"scoring": "sigmoid", "method": "balanced", "normalize": True, "scaling": 2.5},
    "greedy": {"scoring": "softmax", "method": "greedy", "scaling": 1.0},
    "group_limited_greedy": {"scoring": "softmax", "method": "group_limited_greedy", "scaling": 16.0},
    "balanced_softmax": {"scoring": "softmax", "method": "balanced", "scaling": 1.0},
}


def make_spec(name: str, experts: int, top_k: int, n_group: int, topk_group: int, layer: int = 3) -> RoutingSpec:
    return RoutingSpec(top_k=top_k, n_group=n_group, topk_group=topk_group, layer=layer, **SPECS[name])


def fused(logits: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
          spec: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    from deepinfer_moe.router_kernel import router_fits, select_experts

    assert router_fits(spec, logits.shape[1])
    return select_experts(logits, bias, positions, spec)


def by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (ids, weights) sorted by expert id, so rows compare as sets."""
    order = ids.argsort(dim=1)
    return ids.gather(1, order), weights.gather(1, order)


def check_against_reference(name: str, shape: tuple[int, int, int, int], tokens: int, device: str, seed: int) -> None:
    experts, top_k = shape[:2]
    spec = make_spec(name, *shape)
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(tokens, experts, generator=gen)).to(device)
    bias = (0.3 * torch.randn(experts, generator=gen)).to(device)
    positions = torch.randint(0, 1 << 20, (tokens,), generator=gen).to(device)
    ids, weights = fused(logits, bias, positions, spec)
    ref_ids, ref_weights = route(logits, bias if spec.method == "noaux_tc" else None, positions, spec)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (tokens, top_k)
    ids, weights = by_expert(ids, weights)
    ref_ids, ref_weights = by_expert(ref_ids, ref_weights)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}k{}g{}of{}".format(*s))
@pytest.mark.parametrize("tokens", [1, 5, 16, 64])
def test_fused_router_matches_reference(name: str, shape: tuple[int, int, int, int], tokens: int) -> None:
    check_against_reference(name, shape, tokens, "cpu", seed=tokens * 7 + len(name))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}k{}g{}of{}".format(*s))
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_fused_router_matches_reference_on_cuda(name: str, shape: tuple[int, int, int, int], tokens: int) -> None:
    check_against_reference(name, shape, tokens, "cuda", seed=tokens * 7 + len(name))


def test_bias_chooses_but_does_not_weigh() -> None:
    """A large correction bias on experts 60..63 makes them win although their scores are the lowest;
    the weights stay the un-biased scores, normalized."""
    logits = torch.zeros(3, 64)
    logits[:, 60:] = -4.0
    bias = torch.zeros(64)
    bias[60:] = 10.0
    spec = RoutingSpec(top_k=4, method="noaux_tc", normalize=True, scaling=1.0)
    ids, weights = fused(logits, bias, torch.zeros(3, dtype=torch.int64), spec)
    assert [sorted(row) for row in ids.tolist()] == [[60, 61, 62, 63]] * 3
    torch.testing.assert_close(weights, torch.full((3, 4), 0.25), rtol=0, atol=1e-7)


def test_ties_go_to_the_lower_expert_and_keep_the_reference_values() -> None:
    """Logits on a coarse grid tie often: the chosen values (and weights) equal the reference's, and
    among tied experts at the cut the lower ids win."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(-2, 3, (40, 64), generator=gen).float()
    spec = RoutingSpec(top_k=6, method="noaux_tc", normalize=True, scaling=2.5)
    positions = torch.zeros(40, dtype=torch.int64)
    ids, weights = fused(logits, None, positions, spec)
    ref_ids, ref_weights = route(logits, None, positions, spec)
    torch.testing.assert_close(logits.gather(1, ids).sort(dim=1).values,
                               logits.gather(1, ref_ids).sort(dim=1).values, rtol=0, atol=0)
    torch.testing.assert_close(weights.sort(dim=1).values, ref_weights.sort(dim=1).values, rtol=1e-6, atol=1e-6)
    for row, chosen in zip(logits, ids, strict=True):
        cut = row[chosen].min()
        above = (row > cut).nonzero().flatten().tolist()
        at_cut = (row == cut).nonzero().flatten().tolist()[: 6 - len(above)]
        assert sorted(chosen.tolist()) == sorted(above + at_cut)


def test_group_limit_keeps_the_best_groups_by_their_top_two() -> None:
    """Group 0 has the single best expert but a poor second; group 1's top two sum higher: with
    topk_group 1 every expert comes from group 1."""
    logits = torch.full((1, 16), -6.0)
    logits[0, 0] = 6.0   # group 0: one star
    logits[0, 4:6] = 3.0  # group 1: two good ones
    spec = RoutingSpec(top_k=2, method="noaux_tc", n_group=4, topk_group=1, normalize=True)
    ids, _ = fused(logits, torch.zeros(16), torch.zeros(1, dtype=torch.int64), spec)
    assert sorted(ids[0].tolist()) == [4, 5]
    ref_ids, _ = route(logits, torch.zeros(16), torch.zeros(1, dtype=torch.int64), spec)
    assert sorted(ref_ids[0].tolist()) == [4, 5]


def test_router_fits_refuses_what_it_cannot_serve() -> None:
    from deepinfer_moe.router_kernel import router_fits

    assert router_fits(RoutingSpec(top_k=8, n_group=8, topk_group=4), 256)
    assert not router_fits(RoutingSpec(top_k=8), 512)  # more experts than a program holds
    assert not router_fits(RoutingSpec(top_k=8, n_group=8, topk_group=1), 32)  # kept groups hold 4 < k
    assert not router_fits(RoutingSpec(top_k=2, n_group=8, topk_group=4), 8)  # one expert per group
    assert router_fits(RoutingSpec(top_k=2, method="balanced", n_group=8, topk_group=1), 8)  # no groups drawn


def test_backend_offers_select_experts_and_falls_back_with_none() -> None:
    from deepinfer_moe.triton_backend import TritonMoEBackend

    logits = torch.randn(4, 64)
    spec = RoutingSpec(top_k=6)
    assert TritonMoEBackend(fused_router=False).select_experts(logits, None, torch.zeros(4), spec) is None
    assert TritonMoEBackend().select_experts(torch.randn(4, 512), None, torch.zeros(4), spec) is None
    ids, weights = TritonMoEBackend().select_experts(logits, None, torch.zeros(4), spec)
    assert ids.shape == weights.shape == (4, 6)
