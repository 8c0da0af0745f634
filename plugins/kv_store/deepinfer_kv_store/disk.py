"""The ``disk`` store: one checksummed file per block in a directory several engines may share.

A block file is ``<key hex>.kvb``: a 64-byte header (magic, format version, the 16-byte key, the payload
length, a 32-byte BLAKE2b of the payload) followed by the payload. A save writes a temporary file of a
unique name (``.<key hex>.<pid>.<random>.tmp``) and renames it onto the block's name: a rename is atomic,
so a reader sees a whole file or none, a crash mid-write leaves only a temporary file (never read;
removed by the next store that opens the directory once it is old), and two engines saving one block
race harmlessly (the same bytes either way). A file that is truncated, fails its checksum or names
another key is a miss, counted and logged, and is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from deepinfer.errors import ConfigError
from deepinfer.interfaces import KVStoreSpec

logger = logging.getLogger(__name__)

MAGIC = b"DIKVBLK\0"
VERSION = 1
_HEADER = struct.Struct("<8sI16sQ32s")  # magic, version, key, payload bytes, blake2b-256 of the payload
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvb"
STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died


def block_path(folder: Path, key: bytes) -> Path:
    """Where the block ``key`` lives in ``folder``."""
    return folder / f"{key.hex()}{SUFFIX}"


class DiskStore:
    """Block files in ``folder``; at most ``capacity_bytes`` of them (None: unbounded), least recently used
    (file modification time, refreshed by a load) removed first. Safe to share between processes."""

    name = "disk"

    def __init__(self, spec: KVStoreSpec, folder: str, capacity_bytes: int | None, *, fsync: bool = False) -> None:
        self.block_bytes = spec.block_bytes
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"plugins.kv_store.disk_dir={folder!r} cannot be created: {exc}") from exc
        self.file_bytes = HEADER_BYTES + spec.block_bytes
        self.capacity_bytes = capacity_bytes
        if capacity_bytes is not None and capacity_bytes < self.file_bytes:
            raise ConfigError(f"plugins.kv_store.disk_bytes={capacity_bytes} holds no block file of "
                              f"{self.file_bytes} bytes; raise it")
        self.fsync = fsync
        self.lock = threading.Lock()
        self.hits = self.misses = self.saves = self.evictions = self.errors = 0
        self._remove_stale_temporaries()
        self.used_bytes = sum(size for _, _, size in self._files())

    # --------------------------------------------------------------------------------------- contract

    def contains(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if not block_path(self.folder, key).is_file():
                break
            n += 1
        return n

    def save(self, key: bytes, block: torch.Tensor) -> bool:
        """Write the block to a temporary file, then rename it onto its name."""
        if block.numel() != self.block_bytes:
            self._count_error("a block of %d bytes, not %d", block.numel(), self.block_bytes)
            return False
        target = block_path(self.folder, key)
        if target.is_file():
            return True  # already there (saved by this engine or another one sharing the directory)
        payload = memoryview(block.contiguous().numpy())
        header = _HEADER.pack(MAGIC, VERSION, key, len(payload), hashlib.blake2b(payload, digest_size=32).digest())
        tmp = self.folder / f".{key.hex()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._count_error("cannot write %s: %s", target, exc)
            return False
        with self.lock:
            self.saves += 1
            self.used_bytes += self.file_bytes
            over = self.capacity_bytes is not None and self.used_bytes > self.capacity_bytes
        if over:
            self._evict()
        return True

    def load(self, key: bytes, out: torch.Tensor) -> bool:
        """Read the block into ``out`` and check its header and checksum."""
        path = block_path(self.folder, key)
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER_BYTES)
                view = memoryview(out.numpy())
                got = f.readinto(view)
                extra = f.read(1)
        except FileNotFoundError:
            with self.lock:
                self.misses += 1
            return False
        except OSError as exc:
            self._count_error("cannot read %s: %s", path, exc)
            return False
        problem = self._check(header, key, got, extra, view)
        if problem:
            self._count_error("block file %s is %s; treated as a miss and removed", path, problem)
            path.unlink(missing_ok=True)
            return False
        # Least recently used order for eviction; a file another engine removed meanwhile was read whole.
        with contextlib.suppress(OSError):
            os.utime(path)
        with self.lock:
            self.hits += 1
        return True

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {"blocks": self.used_bytes // self.file_bytes, "bytes": self.used_bytes,
                    "capacity_bytes": self.capacity_bytes or 0, "hits": self.hits, "misses": self.misses,
                    "saves": self.saves, "evictions": self.evictions, "errors": self.errors}

    def close(self) -> None:
        """Nothing is held open between calls; the files stay for the next engine."""

    # ---------------------------------------------------------------------------------------- helpers

    def _check(self, header: bytes, key: bytes, got: int | None, extra: bytes, payload: memoryview) -> str:
        """What is wrong with a block file read back ('' when nothing)."""
        if len(header) < HEADER_BYTES or got != self.block_bytes or extra:
            return "truncated or of the wrong size"
        magic, version, stored_key, length, digest = _HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            return "not a block file of this format"
        if stored_key != key or length != self.block_bytes:
            return "a file of another block"
        if hashlib.blake2b(payload, digest_size=32).digest() != digest:
            return "corrupt (checksum mismatch)"
        return ""

    def _count_error(self, message: str, *args: object) -> None:
        with self.lock:
            self.errors += 1
        logger.warning("kv store 'disk': " + message, *args)

    def _files(self) -> list[tuple[float, Path, int]]:
        """``(mtime, path, size)`` of every block file now in the folder."""
        out = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, Path(entry.path), st.st_size))
        return out

    def _evict(self) -> None:
        """Remove the least recently used files until the folder is under 90% of its capacity (the folder
        is rescanned: engines sharing it see each other's files)."""
        assert self.capacity_bytes is not None
        files = sorted(self._files())
        used = sum(size for _, _, size in files)
        target = self.capacity_bytes * 9 // 10
        removed = 0
        for _, path, size in files:
            if used <= target:
                break
            path.unlink(missing_ok=True)
            used -= size
            removed += 1
        with self.lock:
            self.used_bytes = used
            self.evictions += removed

    def _remove_stale_temporaries(self) -> None:
        """Remove temporary files left by writers that died mid-write (older than ``STALE_TMP_S``)."""
        now = time.time()
        for path in self.folder.glob(".*.tmp"):
            try:
                if now - path.stat().st_mtime > STALE_TMP_S:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                continue
