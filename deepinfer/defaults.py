"""The built-in plugin: the core's own strategies and reference backends, registered like any other
plugin but with ``trylast`` hookimpls, so the core runs alone (API.md §1)."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.engine.executor import SyncExecutor
from deepinfer.hookspecs import hookimpl
from deepinfer.interfaces import CacheLayout, RankLoad, ReplayPlan, SchedulableRequest
from deepinfer.model.deepseek_v3 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from deepinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.model.deepseek_v4.v41 import DeepseekV41ForCausalLM
from deepinfer.model.gemma3 import Gemma3ForCausalLM
from deepinfer.model.layers.batch_invariant import (
    BatchInvariantAttentionBackend,
    BatchInvariantGemmBackend,
    BatchInvariantMLABackend,
    BatchInvariantMoEBackend,
)
from deepinfer.model.layers.reference import TorchAttentionBackend, TorchGemmBackend
from deepinfer.model.layers.reference_deepseek import TorchMLABackend, TorchMoEBackend
from deepinfer.model.layers.reference_deepseek_v4 import TorchSinkAttentionBackend
from deepinfer.model.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from deepinfer.parallel.capacity import CapacityAllToAllBackend
from deepinfer.parallel.dispatch import AllToAllBackend


class FCFSPolicy:
    """First come, first served: admit by arrival; preempt the latest arrival."""

    def order(self, waiting: Sequence[SchedulableRequest], now: float) -> list[SchedulableRequest]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    def preemption_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        return max(running, key=lambda r: r.arrival_time)


class ExactReplayPlanner:
    """Exact state restore: recompute the receptive field of the sliding-window layers — every
    sliding layer can see ``window`` tokens back and layers stack, so the state at position p
    depends on at most ``layers × window`` earlier tokens (ARCHITECTURE §6). Compressed layers with a
    window (DeepSeek-V4 CSA/HCA) count as sliding layers, and their compressors' state reaches back
    ``2 × ratio`` more tokens (the open window and the previous one, for overlapping windows)."""

    def plan(self, request: SchedulableRequest, layout: CacheLayout, reason: str) -> ReplayPlan:
        windows = [layer.window for layer in layout.layers
                   if layer.kind == "sliding" or (layer.kind == "compressed" and layer.window)]
        computed = request.num_computed_tokens
        if not windows:
            return ReplayPlan(first_token=computed, visibility_floor=0, mode="full")
        compressor = max((2 * layer.ratio for layer in layout.layers if layer.kind == "compressed"), default=0)
        field = len(windows) * (max(windows) + layout.max_backtrack) + compressor
        return ReplayPlan(first_token=max(0, computed - field), visibility_floor=0, mode="full")


class RoundRobinRouter:
    """Deals requests to data-parallel ranks in turn."""

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: SchedulableRequest, rank_loads: Sequence[RankLoad]) -> int:
        rank = rank_loads[self._next % len(rank_loads)].rank
        self._next += 1
        return rank


class LeastLoadedRouter:
    """Sends a request to the rank with the fewest queued and running tokens (ties: fewer requests,
    then the lowest rank), so long prompts do not pile up on one rank."""

    def route(self, request: SchedulableRequest, rank_loads: Sequence[RankLoad]) -> int:
        return min(rank_loads, key=lambda load: (load.num_tokens, load.num_requests, load.rank)).rank


class LeastRequestsRouter:
    """Sends a request to the rank with the fewest queued and running requests (ties: fewer KV blocks
    in use, then the lowest rank), so ranks run similar batch sizes and a rank whose cache is fuller
    gets the next request last."""

    def route(self, request: SchedulableRequest, rank_loads: Sequence[RankLoad]) -> int:
        return min(rank_loads, key=lambda load: (load.num_requests, load.num_kv_blocks, load.rank)).rank


class BuiltinPlugin:
    """The core's strategies: ``sync`` executor, ``fcfs`` policy, ``exact`` replay, ``round_robin``,
    ``least_loaded`` and ``least_requests`` routers, the Llama-family, Gemma-3 and DeepSeek-V2/V3/V4
    models and the plain-torch reference backends (the expert-parallel all-to-alls, exact and
    fixed-capacity, ops ``dispatch``/``combine``, included)."""

    @hookimpl(trylast=True)
    def deepinfer_model_architectures(self) -> dict[str, type]:
        return {cls.architecture: cls for cls in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                                  DeepseekV3ForCausalLM, DeepseekV2ForCausalLM,
                                                  DeepseekV4ForCausalLM, DeepseekV41ForCausalLM,
                                                  Gemma3ForCausalLM)}

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
    def deepinfer_request_routers(self) -> dict[str, RoundRobinRouter | LeastLoadedRouter | LeastRequestsRouter]:
        return {"round_robin": RoundRobinRouter(), "least_loaded": LeastLoadedRouter(),
                "least_requests": LeastRequestsRouter()}

    @hookimpl(trylast=True)
    def deepinfer_attention_backends(self) -> list[TorchAttentionBackend | TorchMLABackend |
                                                    TorchSinkAttentionBackend]:
        # The batch-invariant CPU backends rank below the reference ones: ``auto`` picks them only when
        # kernels.batch_invariant asks for the capability (model/layers/batch_invariant.py).
        return [TorchAttentionBackend(), TorchMLABackend(), TorchSinkAttentionBackend(),
                BatchInvariantAttentionBackend(), BatchInvariantMLABackend()]

    @hookimpl(trylast=True)
    def deepinfer_moe_backends(self) -> list[TorchMoEBackend | AllToAllBackend | CapacityAllToAllBackend]:
        return [TorchMoEBackend(), AllToAllBackend(), CapacityAllToAllBackend(), BatchInvariantMoEBackend()]

    @hookimpl(trylast=True)
    def deepinfer_gemm_backends(self) -> list[TorchGemmBackend]:
        return [TorchGemmBackend(), BatchInvariantGemmBackend()]
