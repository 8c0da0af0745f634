"""How many ranks a config asks for, which rank this process is (None outside a rank process), and
which experts it loads.

``expert_parallel_size=N`` alone sets ``data_parallel_size=N`` (API.md §4): N ranks, attention data
parallel (each rank owns its requests) and the routed experts spread over the same N ranks.
``data_parallel_size=N`` alone gives N data-parallel ranks that each hold every expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.errors import ConfigError
from deepinfer.interfaces import PlacementPolicy
from deepinfer.parallel.placement import ExpertShard

_current_rank: int | None = None


def parallel_sizes(parallel: Any) -> tuple[int, int]:
    """``(world, expert_parallel)`` from a ``ParallelSection``; raises ``ConfigError`` when the two
    sizes disagree (experts are spread over the data-parallel ranks or not at all)."""
    dp, ep = parallel.data_parallel_size, parallel.expert_parallel_size
    if ep > 1 and dp > 1 and ep != dp:
        raise ConfigError(f"parallel.expert_parallel_size ({ep}) must equal parallel.data_parallel_size ({dp}), "
                          "or one of them must be 1: experts are spread over the data-parallel ranks")
    return max(dp, ep), ep


def current_rank() -> int | None:
    """This process's rank when it is a deepinfer rank process, else None."""
    return _current_rank


def set_current_rank(rank: int) -> None:
    """Mark this process as rank ``rank`` (called once by the rank entry point)."""
    global _current_rank
    _current_rank = rank


@dataclass(frozen=True)
class RankExperts:
    """A rank's start-up expert facts: the experts it loads and the placement policy
    ``parallel.placement_policy`` names (None when no enabled plugin offers placement policies, e.g.
    ``plugins.eplb`` is off: the initial placement then stays), resolved once."""

    shard: ExpertShard
    policy: PlacementPolicy | None
    policy_name: str


def rank_experts(config: Any, host: Any) -> RankExperts | None:
    """For an ``EngineConfig`` and its ``PluginHost``: this rank's ``RankExperts``; None outside a rank
    process or without expert parallelism (every expert is loaded)."""
    world, ep = parallel_sizes(config.parallel)
    if ep <= 1 or _current_rank is None:
        return None
    policy, name = None, ""
    if host.named_offers("deepinfer_placement_policies"):
        name = config.parallel.placement_policy
        policy = host.select("deepinfer_placement_policies", name, "parallel.placement_policy")
    redundant = int(policy.num_redundant_experts) if policy is not None else 0
    return RankExperts(ExpertShard(_current_rank, world, redundant), policy, name)
