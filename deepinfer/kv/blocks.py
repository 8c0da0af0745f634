"""Block allocation with prefix caching: a plain data structure, no tensors.

A full block of tokens is identified by a hash chained along the prefix (the hash of the previous
block and this block's token ids), so equal prefixes map to equal block hashes. Blocks are
ref-counted; a block whose count drops to zero keeps its cached content and waits in an LRU queue
until an allocation needs it (then its hash is forgotten). Block 0 is reserved and never handed out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.kv.pools import RESERVED_BLOCKS

if TYPE_CHECKING:
    from deepinfer.kv.tiers import KVTiers


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash of one full block (16-byte BLAKE2b of the parent hash and the token ids)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


def extend_chain(chain: list[bytes], token_ids: Sequence[int], block_size: int, upto_blocks: int) -> list[bytes]:
    """Append to ``chain`` (the chained hashes of ``token_ids``' leading full blocks) until it holds
    ``upto_blocks`` of them; returns ``chain``."""
    while len(chain) < upto_blocks:
        i = len(chain)
        chain.append(hash_block(chain[-1] if chain else b"", token_ids[i * block_size:(i + 1) * block_size]))
    return chain


class BlockPool:
    """Ref-counted blocks, the prefix-hash table, and the LRU queue of free blocks.

    ``on_evict(block_id, block_hash)``, when set, is called when a cached block is about to be reused
    (its hash forgotten), before anything can rewrite it: the KV tiers demote it (``kv/tiers.py``)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        self.on_evict: Callable[[int, bytes], None] | None = None
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Free blocks, least recently freed first; cached blocks stay here until reused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(RESERVED_BLOCKS, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - RESERVED_BLOCKS

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for b in block_ids:
            if self.ref_count[b] == 0:
                del self.free_queue[b]
            self.ref_count[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting the least recently freed cached ones), or None if too few."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            old = self.block_hash[b]
            if old is not None:
                if self.on_evict is not None:
                    self.on_evict(b, old)
                del self.cached[old]
                self.block_hash[b] = None
            self.ref_count[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; the tail of a table is queued first so it is evicted
        before the shared head of the prefix."""
        for b in reversed(block_ids):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    self.free_queue[b] = None
                    self.free_queue.move_to_end(b, last=False)  # uncached blocks are reused first
                else:
                    self.free_queue[b] = None

    def clear_cache(self) -> None:
        """Forget every prefix hash (blocks stay where they are, anonymous). After a failed step the
        engine cannot tell which registered blocks that step was still to write, so none may be hit."""
        for b in self.cached.values():
            self.block_hash[b] = None
        self.cached.clear()

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Record that ``block_id`` holds the full block ``block_hash``."""
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is cached already; this copy stays anonymous
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id


@dataclass
class PrefixHit:
    """Blocks found in the cache for a request's leading full blocks."""

    block_ids: list[int]
    num_tokens: int


class KVCacheManager:
    """Block tables of requests on top of a ``BlockPool``.

    With ``num_state_slots`` > 0 (models with per-request state, ``kv/state.py``) a request also gets a
    state slot with its first allocation and gives it back with its blocks (``free``), so a preempted
    or finished request releases both at once, under the same deferred-release rule. ``write_floor``
    is the number of leading tokens whose blocks came from the prefix cache: positions below it may be
    recomputed to rebuild state (exact replay) but their paged entries must not be rewritten.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_state_slots: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[bytes]] = {}
        self.lookup_tokens = 0
        self.hit_tokens = 0
        # Free state slots, lowest last (slot 0 is reserved), and the slot of each request holding one.
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(num_state_slots - 1, 0, -1))
        self.slots: dict[str, int] = {}
        self.shared_tokens: dict[str, int] = {}
        # External tiers under the prefix cache (cache.kv_store, kv/tiers.py); None: none.
        self.tiers: KVTiers | None = None
        self.promoted_tokens = 0

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Demote evicted cached blocks to ``tiers`` and promote from them at lookups (``find_prefix``)."""
        self.tiers = tiers
        self.pool.on_evict = tiers.demote

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chain(self, request_id: str, token_ids: Sequence[int], upto_blocks: int) -> list[bytes]:
        """Block hashes of the first ``upto_blocks`` full blocks (memoized per request)."""
        chain = extend_chain(self.hashes.setdefault(request_id, []), token_ids, self.block_size, upto_blocks)
        return chain[:upto_blocks]

    def find_prefix(self, request_id: str, token_ids: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of ``token_ids`` in whole blocks, leaving at least one token to
        compute (its logits give the next token). With KV tiers, the blocks after the device's hit that a
        tier holds are first loaded into free device blocks and cached (``_promote``)."""
        if not self.pool.enable_prefix_caching:
            return PrefixHit([], 0)
        max_blocks = (len(token_ids) - 1) // self.block_size
        chain = self._chain(request_id, token_ids, max_blocks)
        hit = self._lookup(chain)
        if self.tiers is not None and len(hit) < len(chain) and self._promote(chain[len(hit):], hit):
            hit = self._lookup(chain)
        return PrefixHit(hit, len(hit) * self.block_size)

    def prefetch(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Have the tiers read ahead the blocks of a queued request's prompt that ``find_prefix`` will look for
        past the device's hit (``KVTiers.prefetch``), so that its promotion copies from memory. Nothing
        without tiers."""
        if self.tiers is None or not self.pool.enable_prefix_caching:
            return
        chain = self._chain(request_id, token_ids, (len(token_ids) - 1) // self.block_size)
        self.tiers.prefetch(chain[len(self._lookup(chain)):])

    def _lookup(self, chain: Sequence[bytes]) -> list[int]:
        """The device blocks of the leading hashes of ``chain`` that are cached."""
        hit: list[int] = []
        for h in chain:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def _promote(self, chain: Sequence[bytes], hit: Sequence[int]) -> int:
        """Load the leading blocks of ``chain`` that the tiers hold into free device blocks and register
        them as cached (reference count 0: they wait in the LRU queue like any cached block, so a request
        that is not admitted after all leaks nothing). ``hit``, the device blocks before them, is held
        meanwhile so that the allocation cannot evict it. Returns the blocks promoted."""
        assert self.tiers is not None
        wanted = self.tiers.contains(chain)
        if wanted == 0:
            return 0
        self.pool.touch(hit)
        ids: list[int] = []
        try:
            ids = self.pool.allocate(min(wanted, self.pool.num_free)) or []
            loaded = self.tiers.load(chain[:len(ids)], ids)
            for block_id, h in zip(ids[:loaded], chain, strict=False):
                self.pool.register(block_id, h)
        finally:
            self.pool.free(ids)
            self.pool.free(hit)
        self.promoted_tokens += loaded * self.block_size
        return loaded

    def next_block_hash(self, request_id: str, num_tokens: int, hit: PrefixHit) -> bytes | None:
        """The hash of the block right after ``hit`` among the full blocks ``find_prefix`` looked up for a
        request of ``num_tokens`` tokens (call it after ``find_prefix``); None when the hit covers all of
        them (the block holding the last token is always computed)."""
        index = len(hit.block_ids)
        if index >= (num_tokens - 1) // self.block_size:
            return None
        return self.hashes[request_id][index]

    def uncached_tail(self, request_id: str, token_ids: Sequence[int], upto_blocks: int) -> list[bytes]:
        """The hashes of the request's first ``upto_blocks`` full blocks that come after the last one the
        prefix cache holds: blocks it is still to compute, or computed by a step not processed yet
        (blocks are registered in order, so these are a tail of the chain). Empty without prefix caching."""
        if not self.pool.enable_prefix_caching:
            return []
        chain = extend_chain(self.hashes.setdefault(request_id, []), token_ids, self.block_size, upto_blocks)
        tail: list[bytes] = []
        for i in range(upto_blocks - 1, -1, -1):  # from the end: a decoding request's costs one lookup
            if self.pool.lookup(chain[i]) is not None:
                break
            tail.append(chain[i])
        return tail

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's prompt toward the prefix-cache hit rate."""
        self.lookup_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def allocate(self, request_id: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens (taking ``prefix`` blocks first).
        Returns False, changing nothing, if the free blocks do not suffice."""
        table = self.tables.get(request_id, [])
        reused = prefix.block_ids if prefix and not table else []
        extra = self.blocks_needed(num_tokens) - len(table) - len(reused)
        # A prefix hit on a block with no other user takes it out of the free queue.
        taken_free = sum(1 for b in reused if self.pool.ref_count[b] == 0)
        if extra > self.pool.num_free - taken_free:
            return False
        needs_slot = self.has_state_slots and request_id not in self.slots
        if needs_slot and not self.free_slots:
            return False
        if needs_slot:
            self.slots[request_id] = self.free_slots.pop()
        if reused:
            self.shared_tokens[request_id] = len(reused) * self.block_size
        self.pool.touch(reused)
        fresh = self.pool.allocate(max(extra, 0)) or []
        self.tables[request_id] = table + reused + fresh
        return True

    @property
    def has_state_slots(self) -> bool:
        return self.num_state_slots > 1

    def state_slot(self, request_id: str) -> int:
        """The state slot of a request that holds blocks (models with per-request state)."""
        return self.slots[request_id]

    def write_floor(self, request_id: str) -> int:
        """Leading token positions of the request whose blocks are shared through the prefix cache."""
        return self.shared_tokens.get(request_id, 0)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register every full block whose tokens are all computed, for later prefix hits."""
        if not self.pool.enable_prefix_caching:
            return
        table = self.tables[request_id]
        full = min(num_computed // self.block_size, len(table))
        for block_id, h in zip(table[:full], self._chain(request_id, token_ids, full), strict=True):
            self.pool.register(block_id, h)

    def free(self, request_id: str) -> None:
        """Release the request's blocks (cached ones stay reusable until evicted)."""
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.free(table)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)
        self.shared_tokens.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Free the blocks and drop the memoized hashes of a request that is gone for good."""
        self.free(request_id)
        self.hashes.pop(request_id, None)

    def table(self, request_id: str) -> list[int]:
        return self.tables[request_id]
