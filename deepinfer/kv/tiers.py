"""External KV tiers under the device prefix cache (issue 34): demotion on eviction, promotion at admission.

The device prefix cache (``kv/blocks.py``) keeps full blocks by their chained prefix hash until an
allocation evicts them. With ``cache.kv_store`` set, ``KVTiers`` sits under it:

- **Demotion.** When ``BlockPool`` evicts a cached block, ``demote`` packs the block's paged entries of
  every layer into one flat byte buffer (``BlockCodec``) *before* the block can be rewritten — on the CPU
  one concatenation, on CUDA one on the device and a single copy into pinned memory, on a side stream that
  the compute stream then waits for on the device — and queues it. A writer thread saves it to every store
  of the chain (write-through, so a block a host store evicts later is still on disk). The step never waits
  for a store: when the queue is full the demotion is dropped and counted.
- **Promotion.** At admission, after the device lookup stops, ``KVCacheManager.find_prefix`` asks
  ``contains`` how many of the next blocks some tier (or the writer's queue) holds, allocates free device
  blocks for them, ``load``s them (a failed load stops the promotion there: a miss, never wrong KV) and
  registers them in the prefix cache, so the request's prefill computes only the tail.
- **Read-ahead.** When a request is queued, ``KVCacheManager.prefetch`` hands the tiers the hashes of its
  prompt's blocks that the device cache lacks; a reader thread reads those that only a store outside
  memory holds (a disk file: a read and a checksum) — into the memory stores above it, or, with none,
  into a bounded staging area — so that the promotion at admission copies from memory and the scheduling
  thread, which the running requests' steps wait on, never waits for a disk.

Only paged entries travel (``KVPool.paged``); per-request state — sliding-window rings, DeepSeek-V4 state
slots — is rebuilt after a hit by the replay planners, as after any device prefix hit. A key is the
device hash mixed with ``namespace``: a digest of the model identity and cache layout (``namespace_of``),
so blocks of another model, dtype or layout never match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from deepinfer.interfaces import KVStore, KVStoreSpec
from deepinfer.model.transfer import to_device

logger = logging.getLogger(__name__)

_ALIGN = 64  # every part of a packed block starts at a multiple of this (any dtype view stays aligned)
_PENDING_BYTES = 256 << 20  # most bytes of demoted blocks queued for the writer at once
_STAGING_BYTES = 256 << 20  # most bytes of promoted blocks staged on the device at once


def namespace_of(identity: Mapping[str, Any]) -> str:
    """A hex digest of the model identity and cache layout (JSON of ``identity``, keys sorted)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class BlockCodec:
    """Copies one block's entries of every block-indexed tensor to and from a flat ``uint8`` buffer.

    ``tensors``: ``[num_blocks, ...]`` tensors (any dtypes, one device); part ``i`` of a packed block
    holds ``tensors[i][block_id]`` at ``offsets[i]``, each offset a multiple of 64 bytes."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.offsets: list[int] = []
        self._gaps: list[int] = []  # the zero bytes before each part (up to its aligned offset)
        offset = 0
        for t in self.tensors:
            aligned = -(-offset // _ALIGN) * _ALIGN
            self._gaps.append(aligned - offset)
            self.offsets.append(aligned)
            offset = aligned + t[0].numel() * t.element_size()
        self.nbytes = offset
        self.stride = -(-offset // _ALIGN) * _ALIGN  # a row of a staging matrix of packed blocks
        self._zeros = torch.zeros(_ALIGN, dtype=torch.uint8, device=self.tensors[0].device)

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The parts of ``buffer`` seen as each tensor's block (dtype and shape)."""
        views = []
        for t, offset in zip(self.tensors, self.offsets, strict=True):
            part = buffer[offset:offset + t[0].numel() * t.element_size()]
            views.append(part.view(t.dtype).view(t.shape[1:]))
        return views

    def pack(self, block_id: int, out: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy block ``block_id`` of every tensor into ``out`` (``uint8 [nbytes]``): one concatenation of the
        parts' bytes and the alignment gaps on the tensors' device — straight into ``out`` when it is there,
        else into a staging buffer that one copy (``non_blocking``) moves to ``out``."""
        pieces: list[torch.Tensor] = []
        for t, gap in zip(self.tensors, self._gaps, strict=True):
            if gap:  # zeros before a part that starts at the next aligned offset
                pieces.append(self._zeros[:gap])
            pieces.append(t[block_id].reshape(-1).view(torch.uint8))
        if out.device == self._zeros.device:
            torch.cat(pieces, out=out)
        else:
            out.copy_(torch.cat(pieces), non_blocking=non_blocking)

    def unpack(self, buffer: torch.Tensor, block_id: int, non_blocking: bool = False) -> None:
        """Copy a packed block (``uint8 [nbytes]``) into block ``block_id`` of every tensor."""
        for view, t in zip(self._views(buffer), self.tensors, strict=True):
            t[block_id].copy_(view, non_blocking=non_blocking)

    def scatter(self, staging: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Copy packed blocks, the rows of ``staging`` (``uint8 [n, stride]`` on the tensors' device), into
        blocks ``block_ids`` (``int64 [n]``, same device) of every tensor: one indexed copy per tensor."""
        n = staging.shape[0]
        for t, offset in zip(self.tensors, self.offsets, strict=True):
            part = staging[:, offset:offset + t[0].numel() * t.element_size()]
            t.index_copy_(0, block_ids, part.view(t.dtype).view(n, *t.shape[1:]))


class KVTiers:
    """The chain of stores under the device prefix cache (fastest first) and its writer thread.

    ``demote`` and ``promote`` are called by the block manager on the scheduling thread; the writer thread
    only calls the stores' ``save``. ``flush`` waits until every queued demotion is saved."""

    def __init__(self, stores: Sequence[KVStore], codec: BlockCodec, spec: KVStoreSpec,
                 device: torch.device) -> None:
        self.stores = list(stores)
        self.codec = codec
        self.spec = spec
        self.device = device
        self._salt = bytes.fromhex(spec.namespace)
        self._cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self._cuda else None
        # Demoted blocks not yet saved by every store, by key: a promotion may read them from here.
        self._pending: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._max_pending = max(4, _PENDING_BYTES // max(1, codec.nbytes))
        self._queue: queue.Queue[tuple[bytes, torch.Tensor, Any] | None] = queue.Queue()
        # Blocks read ahead for queued requests when no memory store can keep them, oldest first.
        self._staged: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._reading: set[bytes] = set()  # keys being read from a store now (by a promotion or the reader)
        self._read_done = threading.Condition(self._lock)
        self._reads: queue.Queue[list[bytes] | None] = queue.Queue()
        self._memory = [store for store in self.stores if getattr(store, "in_memory", False)]
        # Blocks a promotion copies straight out of a store's memory (``view``), held by that store until the
        # copies are done: (the copies' CUDA event or None, the (store, key) pairs to release), oldest first.
        self._lent: list[tuple[Any, list[tuple[Any, bytes]]]] = []
        self.demoted = 0
        self.dropped = 0
        self.promoted = 0
        self.load_failures = 0
        self.prefetched = 0
        self._writer = threading.Thread(target=self._serve, args=(self._queue, self._write),
                                        name="deepinfer-kv-writer", daemon=True)
        self._writer.start()
        # The read-ahead's thread, when some store is not in memory (one whose loads are worth moving off the
        # scheduling thread).
        self._reader: threading.Thread | None = None
        if len(self._memory) < len(self.stores):
            self._reader = threading.Thread(target=self._serve, args=(self._reads, self._read_ahead),
                                            name="deepinfer-kv-reader", daemon=True)
            self._reader.start()

    # ------------------------------------------------------------------------------------------- keys

    def key(self, block_hash: bytes) -> bytes:
        """The store key of a device block hash: the hash mixed with the namespace (16 bytes)."""
        return hashlib.blake2b(block_hash, digest_size=16, key=self._salt).digest()

    # ---------------------------------------------------------------------------------------- demotion

    def demote(self, block_id: int, block_hash: bytes) -> None:
        """Queue a copy of block ``block_id`` (about to be evicted from the device cache) for every store.
        Called before the block can be rewritten; the host never waits for the copy or the stores."""
        self.save_block(block_id, block_hash, wait=False)

    def save_block(self, block_id: int, block_hash: bytes, *, wait: bool) -> bool:
        """Queue a copy of device block ``block_id`` (full, holding ``block_hash``) for every store. With a
        full queue: ``wait`` waits for the writer (a hand-off publishing its blocks), else the copy is
        dropped and counted (an eviction: the step never waits). False when dropped."""
        key = self.key(block_hash)
        with self._lock:
            if key in self._pending:
                return True
            full = len(self._pending) >= self._max_pending
        if full and wait:
            self.flush()
        elif full:
            with self._lock:
                self.dropped += 1  # the writer is behind: the step does not wait for it
            return False
        event = None
        if self._cuda:
            assert self._side is not None
            buffer = torch.empty(self.codec.nbytes, dtype=torch.uint8, pin_memory=True)
            main = torch.cuda.current_stream(self.device)
            self._side.wait_stream(main)  # the block's last write is ordered before the copy
            with torch.cuda.stream(self._side):
                self.codec.pack(block_id, buffer, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._side)
            main.wait_stream(self._side)  # the block's next write waits for the copy, on the device only
        else:
            buffer = torch.empty(self.codec.nbytes, dtype=torch.uint8)
            self.codec.pack(block_id, buffer)
        with self._lock:
            self._pending[key] = buffer
        self.demoted += 1
        self._queue.put((key, buffer, event))
        return True

    @staticmethod
    def _serve(work: queue.Queue, handle: Callable[[Any], None]) -> None:
        """A thread's loop: ``handle`` every item of ``work`` until a None, marking each done (``join``)."""
        while True:
            item = work.get()
            try:
                if item is None:
                    return
                handle(item)
            finally:
                work.task_done()

    def _write(self, item: tuple[bytes, torch.Tensor, Any]) -> None:
        """Save one demoted block to every store (the writer thread)."""
        key, buffer, event = item
        if event is not None:
            event.synchronize()
        for store in self.stores:
            try:
                store.save(key, buffer)
            except Exception:  # a store must not raise (KVStore.save); keep the writer alive
                logger.exception("KV store %r raised in save; the block is dropped from it", store.name)
        with self._lock:
            self._pending.pop(key, None)
        self._release_lent()

    def flush(self) -> None:
        """Wait until every queued demotion is saved (tests, shutdown, a hand-off)."""
        self._queue.join()

    # --------------------------------------------------------------------------------------- promotion

    def contains(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the queue or some store holds."""
        keys = [self.key(h) for h in block_hashes]
        n = 0
        while n < len(keys):
            with self._lock:
                queued = keys[n] in self._pending
            if queued:
                n += 1
                continue
            best = max((self._contains(store, keys[n:]) for store in self.stores), default=0)
            if best == 0:
                break
            n += best
        return n

    @staticmethod
    def _contains(store: KVStore, keys: Sequence[bytes]) -> int:
        """``store.contains(keys)``; a store that raises holds nothing (logged)."""
        try:
            return store.contains(keys)
        except Exception:  # a store must not raise (KVStore.contains): nothing is promoted from it
            logger.exception("KV store %r raised in contains; treated as holding nothing", store.name)
            return 0

    def load(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Load the blocks ``block_hashes`` into device blocks ``block_ids``, in order, stopping at the
        first one no tier can give back intact; returns how many were loaded. A block found below the
        first store is copied into the stores above it (promotion through the chain)."""
        self._release_lent()
        buffers: list[torch.Tensor] = []
        lent: list[tuple[Any, bytes]] = []
        for block_hash in block_hashes[:len(block_ids)]:
            key = self.key(block_hash)
            buffer = self._read(key, lent)
            if buffer is None:
                with self._lock:
                    self.load_failures += 1
                break
            buffers.append(buffer)
        done = self._copy_in(buffers, block_ids[:len(buffers)]) if buffers else None
        if lent:
            with self._lock:
                self._lent.append((done, lent))
            if done is None:
                self._release_lent()
        self.promoted += len(buffers)
        return len(buffers)

    def _release_lent(self) -> None:
        """Give back the lent blocks whose copies are done (on CUDA: whose event has passed)."""
        with self._lock:
            ready = 0
            while ready < len(self._lent) and (self._lent[ready][0] is None or self._lent[ready][0].query()):
                ready += 1
            released, self._lent = self._lent[:ready], self._lent[ready:]
        for _, pairs in released:
            for store, key in pairs:
                store.release(key)

    def _copy_in(self, buffers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> Any:
        """Copy packed blocks into device blocks ``block_ids``; returns the copies' CUDA event (None on the
        CPU, where they are done on return). On CUDA each block is one host-to-device copy into a staging
        matrix (at most ``_STAGING_BYTES`` at once) that ``BlockCodec.scatter`` spreads with one indexed copy
        per cache tensor, all on the current stream without a host wait."""
        if not self._cuda:
            for buffer, block_id in zip(buffers, block_ids, strict=True):
                self.codec.unpack(buffer, block_id)
            return None
        per_chunk = max(1, _STAGING_BYTES // self.codec.stride)
        for start in range(0, len(buffers), per_chunk):
            chunk = buffers[start:start + per_chunk]
            staging = torch.empty((len(chunk), self.codec.stride), dtype=torch.uint8, device=self.device)
            for row, buffer in zip(staging, chunk, strict=True):
                row[:self.codec.nbytes].copy_(buffer, non_blocking=True)
            ids = to_device(list(block_ids[start:start + len(chunk)]), torch.int64, self.device)
            self.codec.scatter(staging, ids)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def _read(self, key: bytes, lent: list[tuple[Any, bytes]]) -> torch.Tensor | None:
        """The packed block under ``key`` from the queue, the read-ahead (waiting for one in progress, so a
        block is read from a store once) or the first store that returns it intact — in place from a store
        that lends views (``KVStore.view``), the (store, key) then appended to ``lent``."""
        with self._lock:
            while key in self._reading:
                self._read_done.wait()
            queued = self._pending.get(key)
            if queued is None:
                queued = self._staged.pop(key, None)
            if queued is None:
                self._reading.add(key)  # claimed: the reader thread does not read it too
        if queued is not None:
            return queued
        try:
            return self._read_stores(key, lent)
        finally:
            self._release(key)

    def _release(self, key: bytes, staged: torch.Tensor | None = None) -> None:
        """End a claimed read of ``key`` (keeping ``staged``, a read-ahead's block no memory store took) and
        wake whoever waits for it."""
        with self._lock:
            self._reading.discard(key)
            if staged is not None:
                self._staged[key] = staged
                while len(self._staged) > self._max_pending:
                    self._staged.popitem(last=False)
            self._read_done.notify_all()

    def _read_stores(self, key: bytes, lent: list[tuple[Any, bytes]] | None = None) -> torch.Tensor | None:
        """The packed block under ``key`` from the first store that returns it intact, copied into the stores
        above that one. With ``lent`` (a promotion), a store that lends views returns its memory in place,
        held until released, and the (store, key) is appended to ``lent``."""
        buffer: torch.Tensor | None = None
        for depth, store in enumerate(self.stores):
            try:
                if lent is not None and hasattr(store, "view"):
                    found = store.view(key)
                    if found is not None:
                        lent.append((store, key))
                else:
                    if buffer is None:
                        buffer = torch.empty(self.codec.nbytes, dtype=torch.uint8, pin_memory=self._cuda)
                    found = buffer if store.load(key, buffer) else None
                if found is not None:
                    for upper in self.stores[:depth]:
                        upper.save(key, found)
            except Exception:  # a store must not raise (KVStore.load): a miss, never a failed step
                logger.exception("KV store %r raised in load; treated as a miss", store.name)
                continue
            if found is not None:
                return found
        return None

    # --------------------------------------------------------------------------------------- read-ahead

    def prefetch(self, block_hashes: Sequence[bytes]) -> None:
        """Read ahead, on the reader thread, the leading blocks of ``block_hashes`` (a queued request's, after
        its device hit) that no memory store holds; returns at once."""
        if block_hashes and self._reader is not None:
            self._reads.put([self.key(h) for h in block_hashes])

    def _read_ahead(self, keys: Sequence[bytes]) -> None:
        """Read ``keys`` ahead, in order (the reader thread); a failure only costs the admission its own read."""
        try:
            self._read_ahead_in_order(keys)
        except Exception:
            logger.exception("KV read-ahead failed")

    def _read_ahead_in_order(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            with self._lock:
                if key in self._pending or key in self._staged or key in self._reading:
                    continue  # in memory already, or being read (by a promotion: it needs no help)
                self._reading.add(key)
            buffer = None
            try:
                # Checked once claimed, so that a promotion's read that just copied it up is seen.
                if any(self._contains(store, [key]) for store in self._memory):
                    continue
                if not any(self._contains(store, [key]) for store in self.stores):
                    return  # a promotion stops at the first missing block: the rest would not be used
                buffer = self._read_stores(key)  # also copies it into the memory stores above its holder
                with self._lock:
                    if buffer is None:
                        self.load_failures += 1
                    else:
                        self.prefetched += 1
                if buffer is None:
                    return
            finally:
                self._release(key, buffer if not self._memory else None)

    def wait_prefetch(self) -> None:
        """Wait until every read-ahead asked so far is done (tests)."""
        self._reads.join()

    # ------------------------------------------------------------------------------------------- misc

    def stats(self) -> dict[str, Any]:
        """The tiers' counters and each store's (``KVStore.stats``) under its name."""
        out: dict[str, Any] = {"demoted_blocks": self.demoted, "dropped_demotions": self.dropped,
                               "promoted_blocks": self.promoted, "load_failures": self.load_failures,
                               "prefetched_blocks": self.prefetched}
        for store in self.stores:
            out[store.name] = store.stats()
        return out

    def close(self) -> None:
        """Save what is queued, stop the writer and close the stores (once; later calls do nothing)."""
        if not self._writer.is_alive():
            return
        if self._reader is not None:
            self._reads.put(None)
            self._reader.join()
        self.flush()
        self._queue.put(None)
        self._writer.join()
        for store in self.stores:
            store.close()


def build_tiers(factories: Sequence[Callable[[KVStoreSpec], KVStore]], tensors: Sequence[torch.Tensor],
                device: torch.device, identity: Mapping[str, Any]) -> KVTiers:
    """The tiers of an engine: its block-indexed cache ``tensors`` (``KVPool.paged``), one store per
    factory (fastest first), and the namespace of ``identity`` (model and cache layout)."""
    codec = BlockCodec(tensors)
    spec = KVStoreSpec(block_bytes=codec.nbytes, device=device.type, namespace=namespace_of(identity))
    return KVTiers([factory(spec) for factory in factories], codec, spec, device)
