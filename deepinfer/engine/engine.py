"""``LLMEngine``: one model on one device, and its step loop.

Start-up (``engine/startup.py``): config (with plugin aliases) → plugin host → model skeleton →
``EngineInfo`` and plugin checks → backends → weights → KV cache → CUDA graphs → drafter, runner,
speculator → scheduler → request intake; then the core and the executor here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine.core import EngineCore
from deepinfer.engine.cost import StepCost
from deepinfer.engine.executor import SyncExecutor
from deepinfer.engine.heap import HeapTrimmer
from deepinfer.engine.request import Request
from deepinfer.engine.startup import StartUp, resolve_config
from deepinfer.engine.stats import EngineStats
from deepinfer.interfaces import StepStats
from deepinfer.outputs import RequestOutput
from deepinfer.plugins import PluginHost
from deepinfer.sampling.params import SamplingParams
from deepinfer.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model on one device, with its scheduler, cache and executor."""

    def __init__(self, model: str | None = None, *, config: Any = None,
                 overrides: Mapping[str, Any] | None = None, extra_plugins: tuple = ()) -> None:
        resolved, installed = resolve_config(model, config, overrides)
        self.config: EngineConfig = resolved.config
        self.config_sources = resolved.sources
        self.host = PluginHost(self.config.plugins, installed, extra_plugins)
        parts = StartUp(self.config, self.host)
        # What the rest of the package reads of an engine (the parts themselves are built by StartUp).
        self.model_path, self.hf_config = parts.model_path, parts.hf_config
        self.device, self.dtype, self.kv_dtype = parts.device, parts.dtype, parts.kv_dtype
        self.tokenizer, self.eos_token_ids = parts.tokenizer, parts.eos_token_ids
        self.max_model_len, self.max_backtrack = parts.max_model_len, parts.max_backtrack
        self.num_state_slots, self.rank_experts = parts.num_state_slots, parts.rank_experts
        self.model, self.info, self.load_report = parts.model, parts.info, parts.load_report
        self.spec_settings = parts.spec_settings
        self.pool, self.kv, self.kv_tiers = parts.pool, parts.kv, parts.kv_tiers
        self.runner, self.speculator, self.scheduler = parts.runner, parts.speculator, parts.scheduler
        self.intake = parts.intake
        self.stats = EngineStats()
        self.core = EngineCore(
            self.scheduler, self.runner, self.tokenizer, self.stats,
            on_step_end=self._on_step_end if self.host.has_observers("deepinfer_step_end") else None,
            on_request_end=self._on_request_end if self.host.has_observers("deepinfer_request_end") else None,
            speculator=self.speculator, tail=parts.tail,
        )
        executor = self.config.scheduler.executor
        if executor == "auto" and self.device.type == "cpu":
            # The overlapped executor has hidden nothing on a CPU device, where the forward runs on the host's own
            # cores (docs/benchmarks.md: 0.47-0.99x the synchronous one): auto keeps the built-in there.
            executor = "sync"
        factory = self.host.select("deepinfer_step_executors", executor, "scheduler.executor")
        self.executor = factory(self.core)
        if self.speculator is not None and not isinstance(self.executor, SyncExecutor) and self.rank_experts is None:
            # An overlapped executor schedules, and so asks the plan's budget, while a step runs: profile
            # the step-cost curve now, so that no placeholder step ever runs beside a real one. (A rank
            # profiles it itself once its expert-parallel layers are attached: parallel/worker.py.)
            cost = self.speculator.cost
            if isinstance(cost, StepCost):
                cost.profile_all()
        self._grammars: GrammarCompiler | None = None  # structured output, built on first use
        self.heap = HeapTrimmer() if self.device.type == "cpu" else None  # the C heap's free memory (engine/heap.py)
        self.host.notify("deepinfer_engine_started", info=self.info)

    @property
    def uses_mtp(self) -> bool:
        """Whether the drafter is ``mtp`` (the MTP layers' cache is allocated, the runner keeps hidden states)."""
        return self.spec_settings is not None and self.spec_settings.drafter == "mtp"

    # ---------------------------------------------------------------------------------------- requests

    def make_request(self, prompt: str | list[int], params: SamplingParams, *, text: str | None = None) -> Request:
        """Validate, number and seed one request (``RequestIntake.make_request``); raises ``ValueError``
        naming the problem. Nothing is queued."""
        return self.intake.make_request(prompt, params, text=text)

    def add(self, request: Request) -> None:
        """Queue a request from ``make_request`` (this engine's, or in an expert-parallel rank the driver's);
        a structured request's grammar starts compiling here, in the background (the scheduler waits for it)."""
        spec = request.params.grammar_spec
        if spec is not None:
            request.grammar = self._grammar_compiler().request(spec)
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_work()

    @property
    def stream(self) -> bool:
        """Whether ``step()`` also returns the output of every unfinished request that got tokens
        (``AsyncLLM`` turns it on); off, only finished outputs come back."""
        return self.core.stream

    @stream.setter
    def stream(self, value: bool) -> None:
        self.core.stream = value

    def step(self) -> list[RequestOutput]:
        """One executor step. If it raises (``KeyboardInterrupt`` included), every live request is
        aborted and its blocks are freed (``EngineCore.abort_after_failed_step``) before the exception
        propagates, so the next call starts clean."""
        try:
            outputs = self.executor.step()
            if self.core.inflight and not self.scheduler.has_work():
                # Only a step of finished requests is in flight (a follow-up row, engine/followup.py, of a
                # request its previous step ended): read it now, so its blocks come back with the outputs.
                outputs += self.executor.step()
        except BaseException as exc:
            aborted = self.core.abort_after_failed_step(f"aborted: an engine step raised {type(exc).__name__}")
            logger.warning("an engine step raised %s; aborted %d live requests", type(exc).__name__, len(aborted))
            raise
        drained = not self.core.has_work()
        if drained:
            self.runner.work_drained()
        if self.heap is not None:
            self.heap.after_step(drained)
        return outputs

    # ------------------------------------------------------------------------------------------ stats

    def get_stats(self) -> dict[str, Any]:
        """Cumulative counters (API.md §4), one sub-dict per enabled plugin, and under speculative decoding
        ``step_cost``: the step-cost model's prediction error and learned terms (``StepCost.stats``)."""
        kv = self.kv
        stats: dict[str, Any] = {
            "steps": self.stats.steps,
            "prompt_tokens": self.stats.prompt_tokens,
            "generated_tokens": self.stats.generated_tokens,
            "prefix_cache_hit_rate": kv.hit_tokens / kv.lookup_tokens if kv.lookup_tokens else 0.0,
            "prefix_cache_hit_tokens": kv.hit_tokens,  # the rate's parts, for rates over a span (bench runs)
            "prefix_cache_lookup_tokens": kv.lookup_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_sharing_holds": self.scheduler.num_prefix_holds,  # cache.in_step_prefix_sharing
            "kv_blocks_total": kv.pool.num_usable,
            "kv_blocks_free": kv.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "step_time_split": dict(self.stats.phase_seconds),
            "cuda_graph_replays": self.runner.graphs.replays if self.runner.graphs else 0,
            "piecewise_graph_replays": self.runner.piecewise.replays if self.runner.piecewise else 0,
            "device_busy_s": self.stats.device_busy_s,
            "device_idle_s": self.stats.device_idle_s,
            "heap_trims": self.heap.trims if self.heap is not None else 0,  # engine/heap.py (CPU runs)
        }
        if self.speculator is not None and isinstance(self.speculator.cost, StepCost):
            stats["step_cost"] = self.speculator.cost.stats()
        if self.kv_tiers is not None:  # cache.kv_store (kv/tiers.py)
            stats["kv_tiers"] = {"promoted_tokens": kv.promoted_tokens, **self.kv_tiers.stats()}
        stats.update(self.host.plugin_stats())
        return stats

    def _grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler, built by the first structured request (so xgrammar is imported
        only when used); ``ValueError`` as ``RequestIntake.check_structured``."""
        if self._grammars is not None:
            return self._grammars
        self.intake.check_structured()
        assert self.tokenizer is not None
        s = self.config.sampling
        self._grammars = GrammarCompiler(
            self.tokenizer.folder / "tokenizer.json", self.model.vocab_size, self.eos_token_ids,
            threads=s.grammar_threads, timeout_s=s.grammar_timeout_s,
            cache_entries=256 if s.grammar_cache else 0, max_rollback=self.info.layout.max_backtrack + 1)
        return self._grammars

    def _on_step_end(self, stats: StepStats) -> None:
        self.host.notify("deepinfer_step_end", stats=stats)

    def _on_request_end(self, output: RequestOutput) -> None:
        self.host.notify("deepinfer_request_end", output=output)

    def shutdown(self) -> None:
        self.host.notify("deepinfer_engine_stopping")
        if self._grammars is not None:
            self._grammars.shutdown()
        if self.kv_tiers is not None:
            self.kv_tiers.close()

