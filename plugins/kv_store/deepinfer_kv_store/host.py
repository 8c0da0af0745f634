"""The ``host`` store: fixed-size block slots in one (pinned, on CUDA) host tensor, least recently used out."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from deepinfer.errors import ConfigError
from deepinfer.interfaces import KVStoreSpec


class HostStore:
    """Up to ``capacity_bytes // block_bytes`` blocks in host memory; a save into a full store evicts the
    least recently saved or loaded block that no view holds. Thread-safe: one lock guards the index, and the
    copies run outside it (a block being saved is in no index yet; one being loaded is held), so a lookup or
    a ``view`` never waits for a block's copy."""

    name = "host"
    in_memory = True  # a load is a memory copy: not worth reading ahead (KVStore)

    def __init__(self, spec: KVStoreSpec, capacity_bytes: int) -> None:
        self.block_bytes = spec.block_bytes
        self.num_slots = capacity_bytes // spec.block_bytes
        if self.num_slots < 1:
            raise ConfigError(f"plugins.kv_store.host_bytes={capacity_bytes} holds no block of {spec.block_bytes} "
                              "bytes (one full block of every layer); raise it")
        # Pinned memory makes the device copies of a CUDA engine asynchronous; untouched pages cost nothing.
        self.slab = torch.empty((self.num_slots, spec.block_bytes), dtype=torch.uint8,
                                pin_memory=spec.device == "cuda")
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.held: dict[bytes, int] = {}  # key -> views not yet released (such a slot is never rewritten)
        self.lock = threading.Lock()
        self.hits = self.misses = self.saves = self.evictions = self.errors = 0

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are held (the LRU order is not touched)."""
        with self.lock:
            n = 0
            for key in keys:
                if key not in self.index:
                    break
                n += 1
            return n

    def save(self, key: bytes, block: torch.Tensor) -> bool:
        """Copy ``block`` into a free slot, or the least recently used one's."""
        if block.numel() != self.block_bytes:
            with self.lock:
                self.errors += 1
            return False
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
                return True
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                victim = next((k for k in self.index if k not in self.held), None)
                if victim is None:  # every block is lent to a copy in flight
                    self.errors += 1
                    return False
                slot = self.index.pop(victim)
                self.evictions += 1
        self.slab[slot].copy_(block)  # the slot is in no index meanwhile: nobody reads it
        with self.lock:
            if key in self.index:  # saved by another thread meanwhile: keep that copy
                self.free_slots.append(slot)
            else:
                self.index[key] = slot
                self.saves += 1
            return True

    def load(self, key: bytes, out: torch.Tensor) -> bool:
        """Copy the block under ``key`` into ``out``; it becomes the most recently used."""
        block = self.view(key)
        if block is None:
            return False
        try:
            out.copy_(block)
        finally:
            self.release(key)
        return True

    def view(self, key: bytes) -> torch.Tensor | None:
        """The block under ``key`` in place (a row of the slab, pinned on CUDA), held — never evicted or
        rewritten — until ``release(key)``; it becomes the most recently used. None when missing."""
        with self.lock:
            slot = self.index.get(key)
            if slot is None:
                self.misses += 1
                return None
            self.index.move_to_end(key)
            self.held[key] = self.held.get(key, 0) + 1
            self.hits += 1
            return self.slab[slot]

    def release(self, key: bytes) -> None:
        """End one ``view`` of ``key``."""
        with self.lock:
            left = self.held.pop(key, 1) - 1  # after close: nothing held
            if left:
                self.held[key] = left

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {"blocks": len(self.index), "bytes": len(self.index) * self.block_bytes,
                    "capacity_bytes": self.num_slots * self.block_bytes, "hits": self.hits, "misses": self.misses,
                    "saves": self.saves, "evictions": self.evictions, "errors": self.errors}

    def close(self) -> None:
        with self.lock:
            self.index.clear()
            self.held.clear()
            self.free_slots = list(range(self.num_slots - 1, -1, -1))
