"""THE contract between the deepinfer core and its plugins (API.md §2).

Every hook is called with keyword arguments only. Three kinds:

* **Providers** (collect-all): each implementation returns named strategies or backends; the config
  chooses one by name. A name offered by two plugins is a start-up error naming both, so an A/B
  result never depends on install order.
* **Checks and aliases**: refuse a config combination at start-up; map environment knobs to fields.
* **Observers**: see what happened; they must change nothing and must not sync the device.

Plugin authors import the marker as ``from deepinfer import hookimpl``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.interfaces import (
        AttentionBackend,
        EngineInfo,
        GemmBackend,
        KVStoreFactory,
        MoEBackend,
        PlacementPolicy,
        ReplayPlanner,
        RequestRouter,
        SchedulePolicy,
        StepExecutorFactory,
        StepStats,
        VerificationPlan,
    )
    from deepinfer.outputs import RequestOutput

PROJECT = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# ---------------------------------------------------------------------------------------------- providers


@hookspec
def deepinfer_model_architectures() -> Mapping[str, type]:
    """Model classes by ``config.json`` ``architectures[0]`` (e.g. ``"LlamaForCausalLM"``).

    A class is built as ``cls(hf_config: dict, *, dtype, device)`` and must follow the core's model
    protocol (``deepinfer.model.base.CausalLM``): ``cache_specs()``, ``forward(input_ids, ctx)``,
    ``compute_logits(hidden)``, ``load_weights(iterable of (name, tensor))``.
    """


@hookspec
def deepinfer_step_executors() -> Mapping[str, StepExecutorFactory]:
    """Step executors by name; chosen by ``scheduler.executor`` (``auto``: the one an enabled plugin
    offers if exactly one does, else the built-in ``sync``). A factory takes the core's
    ``StepContext`` and returns an object with ``step() -> list[RequestOutput]``."""


@hookspec
def deepinfer_schedule_policies() -> Mapping[str, SchedulePolicy]:
    """Scheduling policies by name; chosen by ``scheduler.policy`` (default ``fcfs``)."""


@hookspec
def deepinfer_drafters() -> Mapping[str, Any]:
    """Drafter factories by name; chosen by ``speculative.drafter``. A factory receives the
    model and the engine info and returns a ``Drafter``. The engine speculates only when an enabled
    plugin offers drafters (and ``speculative.max_draft`` > 0). A factory whose drafter keeps rows per
    main-pool slot (``interfaces.SlotCachingDrafterFactory``) has them counted in the KV budget."""


@hookspec
def deepinfer_verification_plans() -> Mapping[str, VerificationPlan]:
    """Verification plans by name; chosen by ``speculative.plan``."""


@hookspec
def deepinfer_replay_planners() -> Mapping[str, ReplayPlanner]:
    """Replay planners by name; chosen by ``cache.replay`` (``auto``: an enabled plugin's if exactly
    one offers one, else the built-in ``exact``)."""


@hookspec
def deepinfer_placement_policies() -> Mapping[str, PlacementPolicy]:
    """Expert placement policies by name; chosen by ``parallel.placement_policy``. Without an enabled
    plugin that offers one, an expert-parallel run keeps its initial placement."""


@hookspec
def deepinfer_request_routers() -> Mapping[str, RequestRouter]:
    """Data-parallel request routers by name; chosen by ``parallel.router`` (``round_robin``)."""


@hookspec
def deepinfer_kv_stores() -> Mapping[str, KVStoreFactory]:
    """External KV tiers by name (``interfaces.KVStore``); chosen by ``cache.kv_store`` (none by default).

    ``cache.kv_store`` names one store or a chain of them joined by ``+``, fastest first (``host+disk``);
    each name must be offered by exactly one enabled plugin. A factory takes the engine's
    ``KVStoreSpec`` (block size in bytes, device type, namespace) and returns a ``KVStore``. The core
    (``deepinfer/kv/tiers.py``) owns the mechanism: a full block evicted from the device prefix cache is
    written to every tier of the chain on a worker thread (a side stream copies it out on GPU), and a
    device miss whose next blocks some tier holds is loaded back into free device blocks before the
    request's prefill, which then computes only the tail."""


@hookspec
def deepinfer_attention_backends() -> list[AttentionBackend]:
    """Attention backends with their ``ops`` and ``capabilities``. Per op, ``kernels.attention: auto``
    picks the highest ``priority`` backend that is ``available()`` and fits the run."""


@hookspec
def deepinfer_moe_backends() -> list[MoEBackend]:
    """MoE backends (op ``experts``; ``dispatch``/``combine`` for expert parallelism); chosen by
    ``kernels.moe`` like attention backends. A backend may lay out or quantize the expert weights once
    through the optional ``prepare_experts`` (``interfaces.MoEBackend``)."""


@hookspec
def deepinfer_gemm_backends() -> list[GemmBackend]:
    """GEMM backends (op ``linear``); chosen by ``kernels.gemm`` like attention backends."""


@hookspec
def deepinfer_weight_quantizations() -> list[str]:
    """The ``model.quantization`` values (other than ``none``) this plugin serves: for a run with one of
    them it offers, in ``deepinfer_gemm_backends``, a ``linear`` backend that keeps the GEMM weights in that
    format, and refuses in ``deepinfer_validate_config`` the runs it cannot serve (naming the fix). The core
    refuses at start-up a value that no enabled plugin lists."""


# ---------------------------------------------------------------------------------- checks and aliases


@hookspec
def deepinfer_validate_config(config: EngineConfig, info: EngineInfo) -> None:
    """Raise ``deepinfer.errors.ConfigError`` to refuse a combination, naming the plugin and the fix.

    ``info`` is resolved from the model before plugins are built (layer kinds and windows, vocabulary,
    MTP layers, ``max_draft``, ``max_backtrack``, device, world size). Return value ignored.
    """


@hookspec
def deepinfer_config_aliases() -> Mapping[str, Any]:
    """Environment names, and old config paths, mapped onto config paths, e.g.
    ``{"DEEPINFER_ENABLE_MTP_VARLEN": "speculative.plan", "plugins.spec_decode.max_draft":
    "speculative.max_draft"}``: a dotted key is an old path, moved onto the new one in every config
    source and, when the plugin's section is configured, mirrored back into it after validation. An
    environment name may also map to ``(path, implied)``, ``implied`` giving other paths the values the
    variable implies unless a variable sets them (``DEEPINFER_USE_NEXTN_DECODE`` implies the plugin on
    with the ``fixed`` plan, as in the reference).
    Called for every installed plugin, enabled or not, before the config is validated (a module-level
    function is enough; instances are not built yet)."""


@hookspec
def deepinfer_drafter_trainers() -> Mapping[str, Any]:
    """Drafter trainers by drafter name, for ``deepinfer train-drafter --drafter NAME``. Called for every
    installed plugin, enabled or not (a staticmethod, like ``deepinfer_config_aliases``). A trainer is
    called as ``trainer(model, *, output, minutes, device, engine_overrides, recipe)``: ``model`` a folder or
    alias, ``output`` the weights file (None: the plugin's cache for ``auto``), ``minutes`` the training
    budget (None: the recipe's steps), ``device`` ``cpu``/``cuda`` (None: the engine's default),
    ``engine_overrides`` ``LLM`` keyword overrides for the target, ``recipe`` field overrides of the
    plugin's training recipe; it returns the path of the weights it wrote."""


# --------------------------------------------------------------------------------------------- observers


@hookspec
def deepinfer_engine_started(info: EngineInfo) -> None:
    """The engine is loaded and ready to take requests."""


@hookspec
def deepinfer_engine_stopping() -> None:
    """The engine is shutting down; release plugin resources."""


@hookspec
def deepinfer_step_end(stats: StepStats) -> None:
    """An executor step finished. Must not block or sync the device."""


@hookspec
def deepinfer_request_end(output: RequestOutput) -> None:
    """A request finished (any ``finish_reason``); ``output`` is final and must not be mutated."""


@hookspec
def deepinfer_stats() -> Mapping[str, Any]:
    """This plugin's counters, shown by ``LLM.get_stats()`` under the plugin's name."""
