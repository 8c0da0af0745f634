"""Whether an ``LLM(...)`` call asks for several ranks (decided before any model is loaded)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer.config import build_config
from deepinfer.parallel.sizes import parallel_sizes
from deepinfer.plugins import config_aliases, discover_plugins


def requested_world_size(model: str | None, config: Any, overrides: Mapping[str, Any]) -> int:
    """The number of ranks the layered config (file, environment, overrides) asks for."""
    tree = dict(overrides)
    if model is not None:
        tree["model"] = {**tree.get("model", {}), "path": model}
    resolved = build_config(config=config, overrides=tree, aliases=config_aliases(discover_plugins()))
    return parallel_sizes(resolved.config.parallel)[0]
