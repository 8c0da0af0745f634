"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

import logging
from typing import Any

from deepinfer import hookimpl
from deepinfer.interfaces import EngineInfo
from deepinfer_eplb.config import EPLBConfig
from deepinfer_eplb.policies import DeepSeekPolicy, GreedyMultistepPolicy
from deepinfer_eplb.schedule import RebalanceSchedule

logger = logging.getLogger(__name__)


class Plugin:
    """Offers the ``greedy_multistep`` and ``deepseek`` placement policies, both on the schedule and
    sizes of ``plugins.eplb``; the core (``deepinfer.parallel``) collects statistics, moves weights and
    routes tokens to replicas."""

    config_model = EPLBConfig

    def __init__(self, config: EPLBConfig) -> None:
        self.config = config
        schedule = RebalanceSchedule(config.interval, config.window)
        self.policies = {cls.name: cls(schedule, config.num_redundant_experts)
                         for cls in (GreedyMultistepPolicy, DeepSeekPolicy)}

    @staticmethod
    def deepinfer_config_aliases() -> dict[str, str]:
        return {"DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "plugins.eplb.interval",
                "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "plugins.eplb.window",
                "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "plugins.eplb.num_redundant_experts",
                # The policy is the core's parallel.placement_policy (resolved before plugins are built,
                # for the rank's expert shard); the old key stays accepted and mirrors it.
                "plugins.eplb.policy": "parallel.placement_policy"}

    @hookimpl
    def deepinfer_placement_policies(self) -> dict[str, Any]:
        return dict(self.policies)

    @hookimpl
    def deepinfer_validate_config(self, config: Any, info: EngineInfo) -> None:
        if info.world_size == 1:
            logger.info("plugins.eplb: one rank, so there is nothing to balance (set expert_parallel_size)")

    @hookimpl
    def deepinfer_stats(self) -> dict[str, float]:
        """Placements this process computed and the seconds spent in the policies."""
        return {"placements_computed": sum(p.placements for p in self.policies.values()),
                "policy_compute_seconds": sum(p.seconds for p in self.policies.values())}
