"""The built-in plugin: the core's own strategies and reference backends, registered like any other
plugin but with ``trylast`` hookimpls, so the core runs alone (API.md §1)."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.engine.executor import SyncExecutor
from deepinfer.hookspecs import hookimpl
from deepinfer.interfaces import CacheLayout, RankLoad, ReplayPlan, SchedulableRequest
from deepinfer.model.deepseek_v3 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from deepinfer.model.layers.reference import TorchAttentionBackend, TorchGemmBackend
from deepinfer.model.layers.reference_deepseek import TorchMLABackend, TorchMoEBackend
from deepinfer.model.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


class FCFSPolicy:
    """First come, first served: admit by arrival; preempt the latest arrival."""

    def order(self, waiting: Sequence[SchedulableRequest], now: float) -> list[SchedulableRequest]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    def preemption_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        return max(running, key=lambda r: r.arrival_time)


class ExactReplayPlanner:
    """Exact state restore: recompute the receptive field of the sliding-window layers — every
    sliding layer can see ``window`` tokens back and layers stack, so the state at position p
    depends on at most ``layers × window`` earlier tokens (ARCHITECTURE §6)."""

    def plan(self, request: SchedulableRequest, layout: CacheLayout, reason: str) -> ReplayPlan:
        windows = [layer.window for layer in layout.layers if layer.kind == "sliding"]
        computed = request.num_computed_tokens
        if not windows:
            return ReplayPlan(first_token=computed, visibility_floor=0, mode="full")
        field = len(windows) * (max(windows) + layout.max_backtrack)
        return ReplayPlan(first_token=max(0, computed - field), visibility_floor=0, mode="full")


class RoundRobinRouter:
    """Deals requests to data-parallel ranks in turn."""

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: SchedulableRequest, rank_loads: Sequence[RankLoad]) -> int:
        rank = rank_loads[self._next % len(rank_loads)].rank
        self._next += 1
        return rank


class BuiltinPlugin:
    """The core's strategies: ``sync`` executor, ``fcfs`` policy, ``exact`` replay, ``round_robin``
    router, the Llama-family and DeepSeek-V2/V3 models and the plain-torch reference backends."""

    @hookimpl(trylast=True)
    def deepinfer_model_architectures(self) -> dict[str, type]:
        return {cls.architecture: cls for cls in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                                  DeepseekV3ForCausalLM, DeepseekV2ForCausalLM)}

    @hookimpl(trylast=True)
    def deepinfer_step_executors(self) -> dict[str, type]:
        return {"sync": SyncExecutor}

    @hookimpl(trylast=True)
    def deepinfer_schedule_policies(self) -> dict[str, FCFSPolicy]:
        return {"fcfs": FCFSPolicy()}

    @hookimpl(trylast=True)
    def deepinfer_replay_planners(self) -> dict[str, ExactReplayPlanner]:
        return {"exact": ExactReplayPlanner()}

    @hookimpl(trylast=True)
    def deepinfer_request_routers(self) -> dict[str, RoundRobinRouter]:
        return {"round_robin": RoundRobinRouter()}

    @hookimpl(trylast=True)
    def deepinfer_attention_backends(self) -> list[TorchAttentionBackend | TorchMLABackend]:
        return [TorchAttentionBackend(), TorchMLABackend()]

    @hookimpl(trylast=True)
    def deepinfer_moe_backends(self) -> list[TorchMoEBackend]:
        return [TorchMoEBackend()]

    @hookimpl(trylast=True)
    def deepinfer_gemm_backends(self) -> list[TorchGemmBackend]:
        return [TorchGemmBackend()]
