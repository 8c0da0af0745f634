"""Expert-parallel MoE: one rank's share of a layer's experts, and the forward that routes tokens to
every rank's share (dispatch → local experts → combine).

An MoE module is *EP-capable* when it has stacked expert weights ``w13 [R, 2I, H]`` and
``w2 [R, H, I]``, ``num_experts`` (logical experts), ``expert_ids`` (the logical expert of each of the
R rows: every expert in order, or the rank's ``ExpertShard`` when the model was built with one) and an
attribute ``expert_parallel`` (None by default) that its forward calls as
``expert_parallel(x, topk_ids, topk_weights, ctx[, swiglu_limit=…])`` instead of the ``experts`` op
when set (``DeepseekMoE`` in ``model/deepseek_v3.py``, ``V4MoE`` in ``model/deepseek_v4/moe.py``).
``attach_expert_parallel`` hands each such module's rows to an ``ExpertParallelMoE`` as the rank's
slots: a model built with the rank's shard already holds exactly them (nothing is copied); a model
holding every expert gives up the rows the rank does not hold.

Local expert compute still goes through the selected ``experts`` backend (the rows received are
computed as single-choice tokens of weight 1 over the local slots), so fast MoE kernels serve EP too.

A fixed-capacity dispatch backend (``fixed_capacity = True``, ``capacity.py``) gets a ``PairCapacity``
that every rank computes alike: the first MoE layer of each forward agrees with the other ranks on the
most tokens any of them has (one all-reduce of one integer per forward, read on the host), and every
layer of that forward sizes its per-pair rows from it (``pair_capacity``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.parallel.dispatch import PairCapacity
from deepinfer.parallel.placement import logical_to_physical, replica_counts, route_to_replicas


def pair_capacity(max_tokens: int, top_k: int, world: int, factor: float | None) -> PairCapacity:
    """Rows per (source, destination) rank pair when the rank with the most tokens has ``max_tokens``:
    ``ceil(factor · max_tokens · top_k / world)`` capped at the worst case ``max_tokens · top_k`` (every
    choice of every token on one rank; no choice can overflow it, whatever the router did); the worst
    case itself when ``factor`` is None. At least one row."""
    worst = max_tokens * top_k
    rows = worst if factor is None else min(worst, math.ceil(factor * max_tokens * top_k / world))
    rows = max(1, rows)
    return PairCapacity(rows, rows >= worst)


class TokenAgreement:
    """The most tokens any rank has in the current forward, agreed by the first MoE layer (an
    all-reduce of one integer, read on the host: the one deliberate sync of a fixed-capacity forward)
    and read by the later layers of the same forward. Shared by one rank's ``ExpertParallelMoE``s."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.max_tokens = 0

    def agree(self, num_tokens: int, device: torch.device) -> int:
        """Agree on the forward's maximum (every rank calls this at the same layer)."""
        value = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        self.max_tokens = int(value.item())
        return self.max_tokens


class ExpertParallelMoE:
    """One MoE layer's local expert slots and its replica routing map on one rank.

    ``w13 [slots, 2I, H]``, ``w2 [slots, H, I]`` hold the logical experts
    ``phys_to_logical[rank·slots : (rank+1)·slots]``. ``loads [logical]`` (int64, on the device) counts
    the tokens this rank routed to each logical expert since the statistics were last taken.
    """

    def __init__(self, *, layer: int, rank: int, world: int, slots: int, num_logical: int,
                 w13: torch.Tensor, w2: torch.Tensor, phys_to_logical: torch.Tensor,
                 group: dist.ProcessGroup | None, agreement: TokenAgreement | None = None,
                 capacity_factor: float | None = None) -> None:
        self.layer, self.rank, self.world, self.slots = layer, rank, world, slots
        self.num_logical = num_logical
        self.group = group
        # Fixed-capacity dispatch only (see the module docstring); layer 0 agrees, the others read.
        self.agreement = agreement if agreement is not None else TokenAgreement(group)
        self.capacity_factor = capacity_factor
        self.w13, self.w2 = w13, w2
        self.device = w13.device
        self.loads = torch.zeros(num_logical, dtype=torch.int64, device=self.device)
        self.received: list[int] = []  # rows received per forward (host ints, from the split sizes)
        widest = world * slots - num_logical + 1  # the most replicas an expert can have
        self.l2p = torch.full((num_logical, widest), -1, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros(num_logical, dtype=torch.int64, device=self.device)
        self.set_placement(phys_to_logical)

    def set_placement(self, phys_to_logical: torch.Tensor) -> None:
        """Install a new placement row ``[ranks · slots]`` (the weights must already match it). The routing
        maps change in place (a captured graph reads the new ones): ``l2p [logical, most replicas]`` is as
        wide as any placement needs (one expert on every slot the others leave free), −1 padded."""
        row = phys_to_logical.to("cpu", torch.int64).view(1, -1)
        self.phys_to_logical = row[0].clone()
        l2p = logical_to_physical(row, self.num_logical)[0]
        self.l2p.fill_(-1)[:, :l2p.shape[1]].copy_(l2p)
        self.counts.copy_(replica_counts(row, self.num_logical)[0])

    @property
    def local_experts(self) -> list[int]:
        """The logical expert in each local slot."""
        lo = self.rank * self.slots
        return self.phys_to_logical[lo:lo + self.slots].tolist()

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 ctx: ForwardContext, swiglu_limit: float | None = None) -> torch.Tensor:
        """``x [T, H]``, logical ``topk_ids``/``topk_weights [T, k]`` → ``[T, H]`` (every rank calls this
        for every MoE layer of every step, with T = 0 on an idle rank); ``swiglu_limit`` goes to the
        ``experts`` op (DeepSeek-V4's clamp)."""
        flat = topk_ids.reshape(-1)
        self.loads.index_add_(0, flat, torch.ones_like(flat))
        phys = route_to_replicas(topk_ids, self.l2p, self.counts, self.rank)
        comm = ctx.backends["dispatch"]
        capacity = self._capacity(x, topk_ids.shape[1]) if getattr(comm, "fixed_capacity", False) else None
        x_recv, slot_recv, handle = comm.dispatch(x, phys // self.slots, phys % self.slots, world=self.world,
                                                  group=self.group, capacity=capacity)
        self.received.append(x_recv.shape[0])
        ones = torch.ones(x_recv.shape[0], 1, dtype=torch.float32, device=x.device)
        y = ctx.backends["experts"].experts(x_recv, slot_recv.unsqueeze(1), ones, (self.w13, self.w2),
                                            swiglu_limit=swiglu_limit)
        return ctx.backends["combine"].combine(y, handle, topk_weights)


    def _capacity(self, x: torch.Tensor, top_k: int) -> PairCapacity:
        """This forward's ``PairCapacity`` (the first layer agrees on the token maximum first)."""
        num_tokens = x.shape[0]
        if self.layer == 0:
            self.agreement.agree(num_tokens, x.device)
        bound = self.agreement.max_tokens
        if num_tokens > bound:
            raise RuntimeError(f"MoE layer {self.layer} has {num_tokens} tokens, more than the {bound} the ranks "
                               "agreed at layer 0 of this forward; fixed-capacity dispatch needs layer 0 to see "
                               "the most tokens of any layer (kernels.dispatch: torch_all_to_all serves this model)")
        return pair_capacity(bound, top_k, self.world, self.capacity_factor)


def ep_capable_layers(model: nn.Module) -> list[nn.Module]:
    """The model's EP-capable MoE modules of the main forward, in forward order (see the module
    docstring). MTP layers are left out: only drafters run them, and they would desynchronize the
    ranks' collectives."""
    return [m for name, m in model.named_modules()
            if not name.startswith("mtp_layers.") and hasattr(m, "expert_parallel")
            and isinstance(getattr(m, "w13", None), torch.Tensor)]


def attach_expert_parallel(model: nn.Module, *, rank: int, world: int, slots: int,
                           placement: torch.Tensor, group: dist.ProcessGroup | None,
                           capacity_factor: float | None = None) -> list[ExpertParallelMoE]:
    """Give every EP-capable layer its local slots under ``placement [layers, ranks·slots]``, taken
    from the rows the module holds (``expert_ids``; see the module docstring), then drop the module's
    own reference to them (the ``ExpertParallelMoE`` owns the slots, and a shuffle replaces them).
    ``capacity_factor``: ``parallel.dispatch_capacity_factor``, for a fixed-capacity dispatch backend."""
    layers = ep_capable_layers(model)
    agreement = TokenAgreement(group)
    if len(layers) != placement.shape[0]:
        raise ValueError(f"placement has {placement.shape[0]} rows for {len(layers)} MoE layers")
    out = []
    lo = rank * slots
    for i, module in enumerate(layers):
        mine = placement[i, lo:lo + slots].tolist()
        held = list(module.expert_ids)
        if held == mine:  # built with this rank's shard
            w13, w2 = module.w13.data, module.w2.data
        else:
            missing = sorted(set(mine) - set(held))
            if missing:
                raise ValueError(f"MoE layer {i} holds no weights for logical experts {missing} of rank {rank}")
            rows = torch.tensor([held.index(e) for e in mine], dtype=torch.int64, device=module.w13.device)
            w13 = module.w13.data.index_select(0, rows).contiguous()
            w2 = module.w2.data.index_select(0, rows).contiguous()
        ep = ExpertParallelMoE(layer=i, rank=rank, world=world, slots=slots, num_logical=module.num_experts,
                               w13=w13, w2=w2, phys_to_logical=placement[i], group=group,
                               agreement=agreement, capacity_factor=capacity_factor)
        module.w13 = None
        module.w2 = None
        module.expert_parallel = ep
        out.append(ep)
    return out
