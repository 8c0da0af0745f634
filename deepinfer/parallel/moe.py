"""Expert-parallel MoE: one rank's share of a layer's experts, and the forward that routes tokens to
every rank's share (dispatch → local experts → combine).

An MoE module is *EP-capable* when it has stacked expert weights ``w13 [E, 2I, H]`` and
``w2 [E, H, I]`` and an attribute ``expert_parallel`` (None by default) that its forward calls as
``expert_parallel(x, topk_ids, topk_weights, ctx)`` instead of the ``experts`` op when set
(``deepinfer/model/deepseek_v3.py``'s ``DeepseekMoE``). ``attach_expert_parallel`` replaces each such
module's full weights with the slots its rank holds, so a rank keeps only its share in memory.

Local expert compute still goes through the selected ``experts`` backend (the rows received are
computed as single-choice tokens of weight 1 over the local slots), so fast MoE kernels serve EP too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.parallel.placement import logical_to_physical, replica_counts, route_to_replicas


class ExpertParallelMoE:
    """One MoE layer's local expert slots and its replica routing map on one rank.

    ``w13 [slots, 2I, H]``, ``w2 [slots, H, I]`` hold the logical experts
    ``phys_to_logical[rank·slots : (rank+1)·slots]``. ``loads [logical]`` (int64, on the device) counts
    the tokens this rank routed to each logical expert since the statistics were last taken.
    """

    def __init__(self, *, layer: int, rank: int, world: int, slots: int, num_logical: int,
                 w13: torch.Tensor, w2: torch.Tensor, phys_to_logical: torch.Tensor,
                 group: dist.ProcessGroup | None) -> None:
        self.layer, self.rank, self.world, self.slots = layer, rank, world, slots
        self.num_logical = num_logical
        self.group = group
        self.w13, self.w2 = w13, w2
        self.device = w13.device
        self.loads = torch.zeros(num_logical, dtype=torch.int64, device=self.device)
        self.received: list[int] = []  # rows received per forward (host ints, from the split sizes)
        self.set_placement(phys_to_logical)

    def set_placement(self, phys_to_logical: torch.Tensor) -> None:
        """Install a new placement row ``[ranks · slots]`` (the weights must already match it)."""
        row = phys_to_logical.to("cpu", torch.int64).view(1, -1)
        self.phys_to_logical = row[0].clone()
        self.l2p = logical_to_physical(row, self.num_logical)[0].to(self.device)
        self.counts = replica_counts(row, self.num_logical)[0].to(self.device)

    @property
    def local_experts(self) -> list[int]:
        """The logical expert in each local slot."""
        lo = self.rank * self.slots
        return self.phys_to_logical[lo:lo + self.slots].tolist()

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        """``x [T, H]``, logical ``topk_ids``/``topk_weights [T, k]`` → ``[T, H]`` (every rank calls this
        for every MoE layer of every step, with T = 0 on an idle rank)."""
        flat = topk_ids.reshape(-1)
        self.loads.index_add_(0, flat, torch.ones_like(flat))
        phys = route_to_replicas(topk_ids, self.l2p, self.counts, self.rank)
        comm = ctx.backends["dispatch"]
        x_recv, slot_recv, handle = comm.dispatch(x, phys // self.slots, phys % self.slots, world=self.world,
                                                  group=self.group)
        self.received.append(x_recv.shape[0])
        ones = torch.ones(x_recv.shape[0], 1, dtype=torch.float32, device=x.device)
        y = ctx.backends["experts"].experts(x_recv, slot_recv.unsqueeze(1), ones, (self.w13, self.w2))
        return ctx.backends["combine"].combine(y, handle, topk_weights)


def ep_capable_layers(model: nn.Module) -> list[nn.Module]:
    """The model's EP-capable MoE modules of the main forward, in forward order (see the module
    docstring). MTP layers are left out: only drafters run them, and they would desynchronize the
    ranks' collectives."""
    return [m for name, m in model.named_modules()
            if not name.startswith("mtp_layers.") and hasattr(m, "expert_parallel")
            and isinstance(getattr(m, "w13", None), torch.Tensor)]


def attach_expert_parallel(model: nn.Module, *, rank: int, world: int, slots: int,
                           placement: torch.Tensor, group: dist.ProcessGroup | None) -> list[ExpertParallelMoE]:
    """Give every EP-capable layer its local slots under ``placement [layers, ranks·slots]`` (copied
    out of the full weights every rank loaded), then drop the full weights."""
    layers = ep_capable_layers(model)
    if len(layers) != placement.shape[0]:
        raise ValueError(f"placement has {placement.shape[0]} rows for {len(layers)} MoE layers")
    out = []
    lo = rank * slots
    for i, module in enumerate(layers):
        mine = placement[i, lo:lo + slots].to(module.w13.device)
        w13 = module.w13.data.index_select(0, mine).contiguous()
        w2 = module.w2.data.index_select(0, mine).contiguous()
        ep = ExpertParallelMoE(layer=i, rank=rank, world=world, slots=slots, num_logical=module.w13.shape[0],
                               w13=w13, w2=w2, phys_to_logical=placement[i], group=group)
        module.w13 = None  # the full stack is no longer needed: free it
        module.w2 = None
        module.expert_parallel = ep
        out.append(ep)
    return out
