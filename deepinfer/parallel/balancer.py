"""The expert-placement mechanism on one rank: router statistics over a ring window, rebalancing when
the placement policy says it is due, and the balance numbers of ``get_stats()["eplb"]``.

All ranks call ``end_step`` after every lock-step, so their windows stay aligned step by step and a
rebalance happens on all of them at the same step. The policy (a plugin's decision,
``PlacementPolicy``) runs on rank 0 on the window summed over ranks; its answer is validated and
broadcast, then every rank moves weights (``shuffle.py``) and swaps its routing maps, into the buffers
they had (a captured graph sees the new weights and maps). A rebalance the policy says is due is staged:
one layer moves after each step, so no step waits for the whole move (each layer's weights and maps
change together, between steps: every forward sees a consistent placement per layer); a policy due
while one is in progress waits for it. ``rebalance()`` (forced) finishes any staged layers and moves a
new placement's layers all at once.

Balance is mean over max rank load (1.0 = even), summed over steps and layers first:
- *measured*: rows each rank actually received per layer and step, gathered over the last window;
- *predicted before/after* a rebalance: the window's logical loads under the old and the new
  placement with each expert's tokens spread evenly over its replicas (``placement.rank_loads``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.interfaces import PlacementPolicy, Topology
from deepinfer.parallel.moe import ExpertParallelMoE
from deepinfer.parallel.placement import balancedness, rank_loads, validate_placement
from deepinfer.parallel.shuffle import ShuffleReport, shuffle_layer

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 100  # steps of statistics kept when no policy sets its own (reference default)


class ExpertBalancer:
    """Router statistics and rebalancing for the EP layers of one rank."""

    def __init__(self, layers: list[ExpertParallelMoE], *, policy: PlacementPolicy | None, policy_name: str,
                 topology: Topology, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.layers = layers
        self.policy = policy
        self.policy_name = policy_name
        self.topology = topology
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.window = int(policy.window) if policy is not None else DEFAULT_WINDOW
        if self.window < 1:
            raise ValueError(f"placement policy {policy_name!r} has window {self.window}; it must be ≥ 1")
        num_logical = layers[0].num_logical
        self.loads = torch.zeros(self.window, len(layers), num_logical, dtype=torch.int64, device=device)
        self.received = torch.zeros(self.window, len(layers), dtype=torch.int64)
        self.step = 0
        self.rebalances = 0
        self.policy_s = 0.0
        self.shuffle_s = 0.0
        self.moved = torch.zeros(3, dtype=torch.int64)  # in-rank copies, experts sent, bytes sent (summed)
        self.predicted: tuple[float, float] | None = None
        self._staged: list[tuple[ExpertParallelMoE, torch.Tensor]] = []  # layers still to move, in order
        self._report = ShuffleReport()  # of the rebalance in progress

    # ------------------------------------------------------------------------------------ per step

    def end_step(self) -> bool:
        """Record this lock-step's statistics; move the next layer of a staged rebalance, or start one
        if the policy says it is due. Returns whether a layer moved."""
        slot = self.step % self.window
        for i, ep in enumerate(self.layers):
            self.loads[slot, i].copy_(ep.loads)
            ep.loads.zero_()
            self.received[slot, i] = sum(ep.received)
            ep.received.clear()
        self.step += 1
        if not self._staged and self.policy is not None and self.policy.due(self.step):
            self._plan()
        if not self._staged:
            return False
        self._move(1)
        return True

    def window_loads(self) -> torch.Tensor:
        """``[steps, layers, logical]`` tokens per logical expert over the filled part of the window,
        oldest first, summed over ranks (a collective)."""
        filled = min(self.step, self.window)
        start = self.step % self.window if self.step >= self.window else 0
        ordered = torch.roll(self.loads, -start, dims=0)[:filled].contiguous()
        dist.all_reduce(ordered, group=self.group)
        return ordered

    # ------------------------------------------------------------------------------------- rebalance

    def rebalance(self) -> None:
        """Finish a staged rebalance, then run the policy and move every layer now. A collective: every
        rank must call it at the same step."""
        if self.policy is None:
            raise RuntimeError("rebalance needs a placement policy (enable plugins.eplb)")
        self._move(len(self._staged))
        self._plan()
        self._move(len(self._staged))

    def _plan(self) -> None:
        """Run the policy on rank 0 and broadcast its placement; its layers are staged for ``_move``."""
        assert self.policy is not None
        load = self.window_loads()
        num_layers, num_logical = load.shape[1], load.shape[2]
        physical = self.topology.ranks * self.topology.slots_per_rank
        placement = torch.empty(num_layers, physical, dtype=torch.int64, device=self.device)
        t0 = time.perf_counter()
        if self.rank == 0:
            answer = self.policy.place(load.cpu(), self.topology)
            placement.copy_(validate_placement(answer, num_layers, num_logical, physical,
                                               f"placement policy {self.policy_name!r}"))
        self.policy_s += time.perf_counter() - t0
        dist.broadcast(placement, src=0, group=self.group)
        placement = placement.cpu()
        old = torch.stack([ep.phys_to_logical for ep in self.layers])
        self._staged = list(zip(self.layers, placement, strict=True))
        self._report = ShuffleReport()
        self.rebalances += 1
        ranks = self.topology.ranks
        self.predicted = (balancedness(rank_loads(load.cpu(), old, ranks)),
                          balancedness(rank_loads(load.cpu(), placement, ranks)))
        logger.info("EPLB rebalance %d at step %d with %r: predicted balancedness %.3f -> %.3f",
                    self.rebalances, self.step, self.policy_name, *self.predicted)

    def _move(self, layers: int) -> None:
        """Move the next ``layers`` staged layers (a collective); after the last, add up what moved."""
        if not layers:
            return
        t0 = time.perf_counter()
        for ep, row in self._staged[:layers]:
            shuffle_layer(ep, row, self._report)
        del self._staged[:layers]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the moves are part of the rebalance time
        self.shuffle_s += time.perf_counter() - t0
        if self._staged:
            return
        report = self._report
        moved = torch.tensor([report.local_copies, report.sent, report.bytes_sent], dtype=torch.int64,
                             device=self.device)
        dist.all_reduce(moved, group=self.group)
        self.moved += moved.cpu()

    # ----------------------------------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        """Global balance numbers (a collective; every rank gets the same dict)."""
        filled = min(self.step, self.window)
        mine = self.received[:filled].to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.topology.ranks)]
        dist.all_gather(gathered, mine, group=self.group)
        per_rank = torch.stack(gathered, dim=-1).cpu()  # [steps, layers, ranks]
        out: dict[str, Any] = {
            "policy": self.policy_name if self.policy is not None else None,
            "balancedness": balancedness(per_rank),
            "window_steps": filled,
            "rebalances": self.rebalances,
            "layers_to_move": len(self._staged),
            "policy_seconds": self.policy_s,
            "shuffle_seconds": self.shuffle_s,
            "experts_copied_in_rank": int(self.moved[0]),
            "experts_sent": int(self.moved[1]),
            "bytes_sent": int(self.moved[2]),
            "physical_experts": self.topology.ranks * self.topology.slots_per_rank,
            "slots_per_rank": self.topology.slots_per_rank,
        }
        if self.predicted is not None:
            out["last_predicted_balancedness_before"], out["last_predicted_balancedness_after"] = self.predicted
        return out
