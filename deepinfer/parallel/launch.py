"""How an ``LLM(...)`` call gets its ranks (decided before any model is loaded): how many the config
asks for, and whether ``torchrun`` already started them (this process being one)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer.config import build_config
from deepinfer.parallel.sizes import parallel_sizes
from deepinfer.plugins import config_aliases, discover_plugins

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def requested_world_size(model: str | None, config: Any, overrides: Mapping[str, Any]) -> int:
    """The number of ranks the layered config (file, environment, overrides) asks for."""
    tree = dict(overrides)
    if model is not None:
        tree["model"] = {**tree.get("model", {}), "path": model}
    resolved = build_config(config=config, overrides=tree, aliases=config_aliases(discover_plugins()))
    return parallel_sizes(resolved.config.parallel)[0]


@dataclass(frozen=True)
class TorchrunLaunch:
    """This process's place in a ``torchrun`` launch (its environment variables)."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def num_nodes(self) -> int:
        """The hosts the ranks span (``torchrun`` gives each host the same number of processes)."""
        return -(-self.world // self.local_world)


def torchrun_launch(environ: Mapping[str, str] = os.environ) -> TorchrunLaunch | None:
    """The launch this process belongs to when ``torchrun`` started it (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` all set), else None."""
    if not all(environ.get(name) for name in TORCHRUN_VARIABLES):
        return None
    world = int(environ["WORLD_SIZE"])
    return TorchrunLaunch(rank=int(environ["RANK"]), world=world, local_rank=int(environ["LOCAL_RANK"]),
                          local_world=int(environ.get("LOCAL_WORLD_SIZE") or world))
