"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

from typing import Any

from deepinfer import hookimpl
from deepinfer.errors import ConfigError
from deepinfer.interfaces import Drafter, EngineInfo, StepStats
from deepinfer_spec_decode.calibration import CalibratedDrafter, IsotonicCalibrator
from deepinfer_spec_decode.config import SpecDecodeConfig
from deepinfer_spec_decode.drafter_cache import auto_drafter, train_dspark
from deepinfer_spec_decode.dspark import build_dspark, check_config, context_bytes_per_slot
from deepinfer_spec_decode.mtp import MTPDrafter
from deepinfer_spec_decode.ngram import NgramDrafter
from deepinfer_spec_decode.oracle import OracleDrafter, read_sequences
from deepinfer_spec_decode.plans import FixedPlan, VarlenPlan
from deepinfer_spec_decode.stats import SpecStats


class Plugin:
    """Offers the ``mtp``, ``dspark``, ``ngram`` and ``oracle`` drafters and the ``fixed`` and ``varlen`` plans,
    calibrates every drafter's confidences online, and reports acceptance statistics."""

    config_model = SpecDecodeConfig

    def __init__(self, config: SpecDecodeConfig) -> None:
        self.config = config
        self.calibrator = IsotonicCalibrator(config.max_draft, config.calibration_bins)
        self.stats = SpecStats(config.max_draft)

    @staticmethod
    def deepinfer_config_aliases() -> dict[str, Any]:
        # The drafter, plan and draft count are the core's ``speculative`` section (the engine sizes its
        # rollback reserve from them before plugins are built); this section's old keys stay accepted and
        # mirror the core's values (``config.build_config``).
        # The reference's DEEPINFER_USE_NEXTN_DECODE=k alone speculates k drafts with its default (fixed) plan.
        implied = {"plugins.spec_decode.enabled": True, "speculative.plan": "fixed"}
        return {"DEEPINFER_USE_NEXTN_DECODE": ("speculative.max_draft", implied),
                "DEEPINFER_ENABLE_MTP_VARLEN": "speculative.plan",
                "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE": "plugins.spec_decode.dspark_confidence_temperature",
                "plugins.spec_decode.drafter": "speculative.drafter",
                "plugins.spec_decode.plan": "speculative.plan",
                "plugins.spec_decode.max_draft": "speculative.max_draft"}

    @staticmethod
    def deepinfer_drafter_trainers() -> dict[str, Any]:
        return {"dspark": train_dspark}

    def calibrated(self, drafter: Drafter) -> Drafter:
        return drafter if self.config.calibration == "off" else CalibratedDrafter(drafter, self.calibrator)

    def _ngram(self, *, model: Any, info: EngineInfo) -> Drafter:
        return self.calibrated(NgramDrafter(self.config.ngram_min, self.config.ngram_max))

    def _oracle(self, *, model: Any, info: EngineInfo) -> Drafter:
        cfg = self.config
        sequences = read_sequences(cfg.oracle_file) if cfg.oracle_file else []
        return self.calibrated(OracleDrafter(sequences, info.vocab_size, cfg.oracle_corruption,
                                              cfg.oracle_draft_probs))

    def _mtp(self, *, model: Any, info: EngineInfo) -> Drafter:
        # The engine checked the model (MTP weights loaded, cache bound) when it resolved the drafter.
        return self.calibrated(MTPDrafter(model))

    @hookimpl
    def deepinfer_drafters(self) -> dict[str, Any]:
        return {"mtp": self._mtp, "dspark": DSparkFactory(self), "ngram": self._ngram, "oracle": self._oracle}

    @hookimpl
    def deepinfer_verification_plans(self) -> dict[str, Any]:
        return {"fixed": FixedPlan(), "varlen": VarlenPlan()}

    @hookimpl
    def deepinfer_validate_config(self, config: Any, info: EngineInfo) -> None:
        if info.layout.max_backtrack < self.config.max_draft + 1:
            raise ConfigError(
                f"cache.max_backtrack ({info.layout.max_backtrack}) must be >= plugins.spec_decode.max_draft + 1 "
                f"({self.config.max_draft + 1}): rejected drafts are rolled back")
        if self.config.drafter == "dspark":
            check_config(self.config, info)
        if config.kernels.batch_invariant and config.speculative.plan == "varlen":
            raise ConfigError(
                "speculative.plan='varlen' cannot be combined with kernels.batch_invariant: varlen sizes each "
                "step's verified drafts from measured step times and the neighbours' confidences, so what a "
                "request verifies, and with sampling what it emits, would depend on its batch; use plan 'fixed' "
                "(the reference also requires varlen off for deterministic inference)")

    @hookimpl
    def deepinfer_step_end(self, stats: StepStats) -> None:
        self.stats.observe(stats)
        for raw, v, a in zip(stats.draft_raw_confidence, stats.verified_drafts, stats.accepted_drafts, strict=True):
            self.calibrator.observe(raw, v, a)

    @hookimpl
    def deepinfer_stats(self) -> dict[str, Any]:
        return self.stats.as_dict()


class DSparkFactory:
    """The ``dspark`` drafter's factory: its context cache keeps a row per main-pool slot, which the engine
    counts in the KV budget (``interfaces.SlotCachingDrafterFactory``)."""

    def __init__(self, plugin: Plugin) -> None:
        self.plugin = plugin

    def cache_bytes_per_slot(self, *, model: Any, info: EngineInfo) -> int:
        return context_bytes_per_slot(model, self.plugin.config)

    def __call__(self, *, model: Any, info: EngineInfo) -> Drafter:
        # Asks the model to capture the target layers; the engine sees that and keeps them (runner.hidden_layers).
        config = self.plugin.config
        return self.plugin.calibrated(build_dspark(model, info, config,
                                                    auto_weights=lambda: auto_drafter(info, config)))
