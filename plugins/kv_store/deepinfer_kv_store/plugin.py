"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

from typing import Any

from deepinfer import hookimpl
from deepinfer.errors import ConfigError
from deepinfer.interfaces import KVStore, KVStoreSpec
from deepinfer_kv_store.config import KVStoreConfig
from deepinfer_kv_store.disk import DiskStore
from deepinfer_kv_store.host import HostStore


class Plugin:
    """Offers the ``host`` (LRU in host memory) and ``disk`` (a directory of checksummed block files)
    stores, sized by ``plugins.kv_store``; the core (``deepinfer/kv/tiers.py``) demotes evicted blocks to
    them and promotes blocks back at admission."""

    config_model = KVStoreConfig

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.stores: list[KVStore] = []

    def _host(self, spec: KVStoreSpec) -> HostStore:
        store = HostStore(spec, self.config.host_bytes)
        self.stores.append(store)
        return store

    def _disk(self, spec: KVStoreSpec) -> DiskStore:
        if self.config.disk_dir is None:
            raise ConfigError("cache.kv_store names 'disk' but plugins.kv_store.disk_dir is not set; "
                              "set it to a directory (several engines may share one)")
        store = DiskStore(spec, self.config.disk_dir, self.config.disk_bytes, fsync=self.config.disk_fsync)
        self.stores.append(store)
        return store

    @hookimpl
    def deepinfer_kv_stores(self) -> dict[str, Any]:
        return {"host": self._host, "disk": self._disk}

    @hookimpl
    def deepinfer_stats(self) -> dict[str, float]:
        """Each built store's counters, as ``<store>_<counter>`` (summed over stores of one name)."""
        out: dict[str, float] = {}
        for store in self.stores:
            for key, value in store.stats().items():
                name = f"{store.name}_{key}"
                out[name] = out.get(name, 0) + value
        return out
