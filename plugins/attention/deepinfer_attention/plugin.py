"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

from typing import Any

from deepinfer import hookimpl
from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError
from deepinfer.interfaces import EngineInfo
from deepinfer_attention.batch_invariant import TritonBIAttentionBackend, TritonBIGemmBackend, TritonBIMLABackend
from deepinfer_attention.config import AttentionConfig
from deepinfer_attention.flash_mla import FlashMLABackend
from deepinfer_attention.gemv import TritonGemvBackend
from deepinfer_attention.replay import BoundedReplayPlanner, consumers, min_keep_tokens, windowed
from deepinfer_attention.triton_backends import TritonAttentionBackend, TritonMLABackend
from deepinfer_attention.triton_v4 import TritonV4Backend
from deepinfer_attention.v4_deep_gemm import DeepGemmIndexerBackend


class Plugin:
    """Offers the replay planners and attention backends of this package (README.md)."""

    config_model = AttentionConfig

    def __init__(self, config: AttentionConfig) -> None:
        self.config = config

    @staticmethod
    def deepinfer_config_aliases() -> dict[str, str]:
        return {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "plugins.attention.replay.mode",
                "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "plugins.attention.replay.keep_tokens"}

    @hookimpl
    def deepinfer_replay_planners(self) -> dict[str, BoundedReplayPlanner]:
        replay = self.config.replay
        return {"bounded": BoundedReplayPlanner(replay.mode, replay.keep_tokens, replay.restore)}

    @hookimpl
    def deepinfer_validate_config(self, config: EngineConfig, info: EngineInfo) -> None:
        """Refuse replay settings that cannot take effect or that leave decode an incomplete window."""
        replay = self.config.replay
        truncates, bounds = replay.mode != "off", replay.restore == "bounded" and bool(windowed(info.layout))
        if replay.mode == "off" and replay.restore == "exact":
            return
        if config.cache.replay not in ("auto", "bounded"):
            raise ConfigError(
                f"plugins.attention.replay (mode={replay.mode!r}, restore={replay.restore!r}) acts through the "
                f"'bounded' replay planner, but cache.replay is {config.cache.replay!r}; set cache.replay to "
                "'auto' or 'bounded'")
        if truncates and not consumers(info.layout):
            raise ConfigError(
                f"plugins.attention.replay.mode={replay.mode!r}: YoCo prefill truncation needs a model with YoCo "
                f"consumer layers (DeepSeek-V4 with yoco_num_producer_layers > 0); {info.architecture} has none; "
                "set mode 'off'")
        need = min_keep_tokens(info.layout)
        if (truncates or bounds) and replay.keep_tokens < need:
            window = need - info.layout.max_backtrack
            raise ConfigError(
                f"plugins.attention.replay.keep_tokens={replay.keep_tokens} is too small: it must be at least "
                f"the sliding window ({window}) + cache.max_backtrack ({info.layout.max_backtrack}) = {need}, "
                "so decode still finds a complete window after a rollback")

    @hookimpl
    def deepinfer_attention_backends(self) -> list[Any]:
        limit = self.config.triton_max_query_len
        return [TritonAttentionBackend(max_query_len=limit), TritonMLABackend(max_query_len=limit),
                TritonV4Backend(max_query_len=limit), DeepGemmIndexerBackend(), FlashMLABackend(max_query_len=limit),
                TritonBIAttentionBackend(), TritonBIMLABackend()]

    @hookimpl
    def deepinfer_gemm_backends(self) -> list[Any]:
        return [TritonBIGemmBackend(), TritonGemvBackend()]
