"""The plugin's config section: ``plugins.kv_store``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class KVStoreConfig(BaseModel):
    """``plugins={"kv_store": {"enabled": True}}`` offers the stores ``host`` and ``disk``; the core's
    ``cache.kv_store`` chooses the chain (``host``, ``disk`` or ``host+disk``).

    ``host_bytes``: the host store's capacity (pinned memory when the engine runs on CUDA); it holds
    ``host_bytes // block_bytes`` blocks and evicts the least recently used. ``disk_dir``: the disk
    store's directory (required for ``disk``; several engines may share it). ``disk_bytes``: the most
    bytes of block files in it (None: unbounded); over it, the least recently used files go.
    ``disk_fsync``: fsync each block file before its rename (survives power loss, not only a crash of
    the process; slower)."""

    model_config = ConfigDict(extra="forbid")

    host_bytes: int = Field(default=4 << 30, ge=1)
    disk_dir: str | None = None
    disk_bytes: int | None = Field(default=None, ge=1)
    disk_fsync: bool = False
