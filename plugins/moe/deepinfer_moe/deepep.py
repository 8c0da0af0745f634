"""``deep_ep``: expert-parallel dispatch/combine through DeepEP 2.5 (registry name ``deepinfer-ep``,
import ``deep_ep``; ``reference/kernels.md`` §6).

UNTESTED. DeepEP 2.5 does not build on the lent H200 machine (it needs NCCL ≥ 2.32.3; torch 2.11
ships 2.28.9), so no line of this module has run against the real library. It is written against
DeepEP 2.5's documented Python API (``EPBuffer(group, num_max_tokens_per_rank=, hidden=, num_topk=)``,
``dispatch(x, topk_idx=, topk_weights=, num_experts=)`` → ``(recv_x, recv_topk_idx,
recv_topk_weights, handle, event)``, ``combine(x, handle)`` → ``(combined_x, combined_topk_weights,
event)``) and kept small: the "normal" (CPU-synchronised, exact-size) mode only, bf16 tokens, no
FP8 dispatch, no low-latency mode. It is offered only when ``deep_ep`` imports.

It implements the core's op pair (``deepinfer/parallel/dispatch.py``; the core's all-to-all is the
reference): ``dispatch(x, dest_rank, dest_slot, *, world, group) -> (x_recv, slot_recv, handle)`` and
``combine(y, handle, topk_weights) -> [T, H]``. A choice's DeepEP expert id is
``dest_rank · max_slots + dest_slot`` (``max_slots`` from config bounds the slots per rank), so DeepEP's
rank and local-expert arithmetic give back the core's rank and slot. DeepEP sends a token once per
rank and reports its choices there as local ids (−1: another rank's); the adapter expands those into one
row per (token, local choice) for the ``experts`` op, and before DeepEP's ``combine`` (which sums the
rows of a token across ranks) folds them back per token with the routing weights. Those weights
must therefore travel with the tokens: ``dispatch`` takes ``topk_weights=`` (which the core's
``ExpertParallelMoE`` does not pass yet) and ``combine`` ignores its own ``topk_weights``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.interfaces import BackendCapabilities

logger = logging.getLogger(__name__)


@functools.cache
def deep_ep_module() -> Any | None:
    """``deep_ep`` if it imports with CUDA present, else None (reason logged once)."""
    if not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module("deep_ep")
    except ImportError as exc:
        logger.info("deep_ep backend: deep_ep does not import (%s)", exc)
        return None


@dataclass
class DeepEPHandle:
    """DeepEP's own ``handle`` and buffer, plus the expansion of received tokens into pair rows: ``token [M]``
    (received-token row of each pair row), ``weight [M]`` (its routing weight), ``num_recv`` tokens."""

    handle: Any
    buffer: Any
    token: torch.Tensor
    weight: torch.Tensor
    num_recv: int


class DeepEPBackend:
    """Ops ``dispatch``/``combine`` over a DeepEP ``EPBuffer`` (see the module docstring)."""

    name = "deep_ep"
    # Below the core's all-to-all (0): until the core's expert-parallel forward passes topk_weights to
    # dispatch, this adapter must be named (kernels.moe: deep_ep), never picked by auto.
    priority = -1
    ops = frozenset({"dispatch", "combine"})
    capabilities = BackendCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.bfloat16}),
                                       graph_safe=False, batch_invariant=False, varlen=True)

    def __init__(self, *, max_slots: int = 288, max_tokens_per_rank: int = 4096) -> None:
        self.max_slots = max_slots
        self.max_tokens_per_rank = max_tokens_per_rank
        self._buffers: dict[tuple[int, int, int], Any] = {}

    def available(self) -> bool:
        return deep_ep_module() is not None

    def _buffer(self, group: dist.ProcessGroup | None, hidden: int, top_k: int) -> Any:
        """One ``EPBuffer`` per (group, hidden, top-k), created on first use (collective: every rank
        reaches its first dispatch together, as the core's lock-step ranks do)."""
        lib = deep_ep_module()
        if lib is None:
            raise RuntimeError("deep_ep backend: deep_ep is not importable here (the deepinfer-ep package and "
                               "a CUDA GPU are needed)")
        group = group or dist.group.WORLD
        key = (id(group), hidden, top_k)
        if key not in self._buffers:
            self._buffers[key] = lib.EPBuffer(group, num_max_tokens_per_rank=self.max_tokens_per_rank,
                                              hidden=hidden, num_topk=top_k)
        return self._buffers[key]

    def dispatch(self, x: torch.Tensor, dest_rank: torch.Tensor, dest_slot: torch.Tensor, *, world: int,
                 group: dist.ProcessGroup | None = None, topk_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, DeepEPHandle]:
        """``x [T, H]`` bf16, ``dest_rank``/``dest_slot``/``topk_weights [T, k]`` → ``(x_recv [M, H],
        slot_recv [M], handle)``, one row per (received token, local choice).

        ``topk_weights`` is required here, unlike the core's all-to-all (which applies them in
        ``combine``): DeepEP's combine sums a token's rows across ranks, so the weights must be applied
        on the expert side, before it. The core's ``ExpertParallelMoE`` does not pass them yet."""
        if topk_weights is None:
            raise ValueError("deep_ep backend: dispatch needs topk_weights= (DeepEP applies routing weights "
                             "on the expert side); the core's expert-parallel forward does not pass them yet")
        lib = deep_ep_module()
        buffer = self._buffer(group, x.shape[1], dest_rank.shape[1])
        expert = (dest_rank * self.max_slots + dest_slot).to(lib.topk_idx_t)
        recv_x, recv_ids, recv_weights, handle, _event = buffer.dispatch(
            x, topk_idx=expert, topk_weights=topk_weights.float(), num_experts=world * self.max_slots)
        token, choice = (recv_ids >= 0).nonzero(as_tuple=True)  # normal mode synchronises anyway
        slot = recv_ids[token, choice].long()
        info = DeepEPHandle(handle, buffer, token, recv_weights[token, choice].float(), recv_x.shape[0])
        return recv_x.index_select(0, token), slot, info

    def combine(self, y: torch.Tensor, handle: DeepEPHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        """``y [M, H]`` unweighted expert outputs → ``[T, H]``: fold each token's local choices with their
        weights, then DeepEP sums the token's rows from every rank (``topk_weights`` already applied)."""
        del topk_weights
        per_token = torch.zeros(handle.num_recv, y.shape[1], dtype=torch.float32, device=y.device)
        per_token.index_add_(0, handle.token, y.float() * handle.weight.unsqueeze(1))
        combined, _weights, _event = handle.buffer.combine(per_token.to(y.dtype), handle.handle)
        return combined
