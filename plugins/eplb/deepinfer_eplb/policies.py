"""The ``PlacementPolicy`` objects this plugin offers (``deepinfer.interfaces.PlacementPolicy``)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from deepinfer.interfaces import Topology
from deepinfer_eplb.deepseek import place_layer_hierarchical
from deepinfer_eplb.greedy import place_layer_multistep
from deepinfer_eplb.schedule import RebalanceSchedule


class _Policy(ABC):
    """Shared face: the schedule and sizes from the config, timing of ``place`` calls."""

    name = ""

    def __init__(self, schedule: RebalanceSchedule, num_redundant_experts: int) -> None:
        self.schedule = schedule
        self.window = schedule.window
        self.num_redundant_experts = num_redundant_experts
        self.placements = 0
        self.seconds = 0.0

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    def place(self, load: torch.Tensor, topology: Topology) -> torch.Tensor:
        """``load [steps, layers, logical]`` → ``phys_to_logical [layers, ranks · slots_per_rank]``."""
        if load.dim() != 3:
            raise ValueError(f"load must be [steps, layers, logical]; got shape {tuple(load.shape)}")
        t0 = time.perf_counter()
        rows = [self._place_layer(load[:, layer].double(), topology) for layer in range(load.shape[1])]
        self.placements += 1
        self.seconds += time.perf_counter() - t0
        return torch.stack(rows) if rows else torch.zeros(0, topology.ranks * topology.slots_per_rank,
                                                           dtype=torch.int64)

    @abstractmethod
    def _place_layer(self, load: torch.Tensor, topology: Topology) -> torch.Tensor:
        """One layer: ``load [steps, logical]`` (float64) → ``[ranks · slots_per_rank]``."""


class GreedyMultistepPolicy(_Policy):
    """Minimizes the sum over window steps of the busiest rank's load (``greedy.py``)."""

    name = "greedy_multistep"

    def _place_layer(self, load: torch.Tensor, topology: Topology) -> torch.Tensor:
        return place_layer_multistep(load, topology.ranks, topology.slots_per_rank)


class DeepSeekPolicy(_Policy):
    """deepseek-ai EPLB on the window's summed load: hierarchical when the expert groups divide
    evenly over the nodes, else global (``deepseek.py``)."""

    name = "deepseek"

    def _place_layer(self, load: torch.Tensor, topology: Topology) -> torch.Tensor:
        weight = load.sum(dim=0)
        physical = topology.ranks * topology.slots_per_rank
        hierarchical = topology.num_groups % topology.num_nodes == 0
        groups, nodes = (topology.num_groups, topology.num_nodes) if hierarchical else (1, 1)
        return place_layer_hierarchical(weight, physical, groups, nodes, topology.ranks)
