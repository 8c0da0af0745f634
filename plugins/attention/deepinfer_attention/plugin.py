"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

from typing import Any

from deepinfer import hookimpl
from deepinfer_attention.config import AttentionConfig


class Plugin:
    """Offers the replay planners and attention backends of this package (README.md)."""

    config_model = AttentionConfig

    def __init__(self, config: AttentionConfig) -> None:
        self.config = config
