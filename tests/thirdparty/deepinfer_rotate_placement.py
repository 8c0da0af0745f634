"""A settings-free third-party plugin offering the placement policy ``rotate``: at its (only)
rebalance, after the third step, slot p holds logical expert ``(p + 3) mod logical``."""

from __future__ import annotations

import torch

from deepinfer import hookimpl
from deepinfer.interfaces import Topology

SHIFT = 3


class RotatePolicy:
    num_redundant_experts = 0
    window = 2

    def __init__(self) -> None:
        self.calls = 0

    def due(self, step: int) -> bool:
        return step == 3

    def place(self, load: torch.Tensor, topology: Topology) -> torch.Tensor:
        self.calls += 1
        physical = topology.ranks * topology.slots_per_rank
        row = (torch.arange(physical) + SHIFT) % load.shape[2]
        return row.unsqueeze(0).repeat(load.shape[1], 1)


@hookimpl
def deepinfer_placement_policies() -> dict[str, RotatePolicy]:
    return {"rotate": RotatePolicy()}
