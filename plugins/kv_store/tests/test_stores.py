"""The ``host`` and ``disk`` stores on their own: LRU capacity, crash-safety, corrupt files, a shared
directory, and the plugin's config errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from deepinfer_kv_store.config import KVStoreConfig
from deepinfer_kv_store.disk import HEADER_BYTES, DiskStore, block_path
from deepinfer_kv_store.host import HostStore
from deepinfer_kv_store.plugin import Plugin

from deepinfer.errors import ConfigError
from deepinfer.interfaces import KVStore, KVStoreSpec

BLOCK = 256
SPEC = KVStoreSpec(block_bytes=BLOCK, device="cpu", namespace="00" * 16)


def _block(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _loaded(store: KVStore, key: bytes) -> torch.Tensor | None:
    out = torch.empty(BLOCK, dtype=torch.uint8)
    return out if store.load(key, out) else None


def test_host_store_keeps_the_most_recently_used_blocks_within_its_bytes() -> None:
    store = HostStore(SPEC, capacity_bytes=3 * BLOCK + 100)  # three blocks fit
    assert isinstance(store, KVStore)
    for i in range(3):
        assert store.save(_key(i), _block(i))
    assert store.contains([_key(0), _key(1), _key(2), _key(3)]) == 3
    assert torch.equal(_loaded(store, _key(0)), _block(0))  # 0 becomes the most recently used
    assert store.save(_key(3), _block(3))  # evicts 1, the least recently used
    assert store.contains([_key(1)]) == 0
    assert store.contains([_key(2), _key(3), _key(0)]) == 3
    assert _loaded(store, _key(1)) is None
    stats = store.stats()
    assert stats["blocks"] == 3 and stats["evictions"] == 1 and stats["capacity_bytes"] == 3 * BLOCK
    assert stats["hits"] == 1 and stats["misses"] == 1
    assert not store.save(_key(9), torch.zeros(BLOCK + 1, dtype=torch.uint8))  # wrong size: refused, counted
    assert store.stats()["errors"] == 1


def test_a_viewed_host_block_is_never_evicted_until_released() -> None:
    store = HostStore(SPEC, capacity_bytes=2 * BLOCK)
    store.save(_key(0), _block(0))
    store.save(_key(1), _block(1))
    view = store.view(_key(0))
    assert view is not None and torch.equal(view, _block(0)) and store.view(_key(7)) is None
    store.view(_key(1))
    store.release(_key(1))  # 1 is held no more; 0 still is
    assert store.save(_key(2), _block(2))  # evicts 1, though 0 is the least recently used
    assert torch.equal(view, _block(0)) and store.contains([_key(0), _key(2)]) == 2 and store.contains([_key(1)]) == 0
    store.view(_key(2))
    assert not store.save(_key(3), _block(3))  # every block held: refused, counted, nothing rewritten
    assert store.stats()["errors"] == 1 and torch.equal(view, _block(0))
    store.release(_key(0))
    assert store.save(_key(3), _block(3))  # 0 is evictable again
    assert store.contains([_key(0)]) == 0 and store.contains([_key(2), _key(3)]) == 2


def test_host_store_smaller_than_a_block_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"plugins\.kv_store\.host_bytes=100 holds no block of 256 bytes"):
        HostStore(SPEC, capacity_bytes=100)


def test_disk_store_round_trips_and_a_second_store_on_the_directory_sees_the_blocks(tmp_path: Path) -> None:
    one = DiskStore(SPEC, str(tmp_path), None)
    two = DiskStore(SPEC, str(tmp_path), None)
    assert one.save(_key(1), _block(1)) and two.save(_key(2), _block(2))
    assert two.save(_key(1), _block(1))  # already there: kept, not rewritten
    assert one.contains([_key(1), _key(2), _key(3)]) == 2
    assert torch.equal(_loaded(two, _key(1)), _block(1))
    assert torch.equal(_loaded(one, _key(2)), _block(2))
    assert _loaded(one, _key(3)) is None
    assert one.stats()["misses"] == 1 and one.stats()["errors"] == 0


@pytest.mark.slow  # two Python processes importing torch: about 8 s on the 2-core VM
def test_two_processes_saving_the_same_blocks_on_one_directory_leave_every_file_whole(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import torch
        from deepinfer.interfaces import KVStoreSpec
        from deepinfer_kv_store.disk import DiskStore
        store = DiskStore(KVStoreSpec({BLOCK}, "cpu", "00" * 16), {str(tmp_path)!r}, None)
        for round in range(20):
            if round % 5 == 4:  # both processes remove and rewrite the same blocks: concurrent renames
                for f in store.folder.glob("*.kvb"):
                    f.unlink(missing_ok=True)
            for i in range(8):
                block = torch.randint(0, 256, ({BLOCK},), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(i))
                store.save(i.to_bytes(16, "little"), block)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    store = DiskStore(SPEC, str(tmp_path), None)
    for i in range(8):
        got = _loaded(store, _key(i))
        assert got is None or torch.equal(got, _block(i))
    assert store.stats()["errors"] == 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_crash_mid_write_leaves_a_temporary_file_that_is_never_read(tmp_path: Path) -> None:
    store = DiskStore(SPEC, str(tmp_path), None)
    # What a writer killed between write and rename leaves: a partial temporary file under its own name.
    partial = tmp_path / f".{_key(5).hex()}.4242.deadbeef.tmp"
    partial.write_bytes(b"DIKVBLK\0" + b"\1" * 40)
    assert store.contains([_key(5)]) == 0 and _loaded(store, _key(5)) is None
    assert store.save(_key(5), _block(5))
    assert torch.equal(_loaded(store, _key(5)), _block(5))
    old = os.path.getmtime(partial) - 3600
    os.utime(partial, (old, old))
    DiskStore(SPEC, str(tmp_path), None)  # a later store removes temporaries of dead writers
    assert not partial.exists()


def test_a_writer_killed_mid_write_leaves_the_directory_readable(tmp_path: Path) -> None:
    """A real kill: a process saves big blocks in a loop and is killed with SIGKILL; every block file left
    is whole (the rename is atomic) and the temporaries are ignored."""
    big = 1 << 20
    script = textwrap.dedent(f"""
        import sys, torch
        from deepinfer.interfaces import KVStoreSpec
        from deepinfer_kv_store.disk import DiskStore
        store = DiskStore(KVStoreSpec({big}, "cpu", "00" * 16), {str(tmp_path)!r}, None)
        block = torch.full(({big},), 7, dtype=torch.uint8)
        i = 0
        while True:
            store.save(i.to_bytes(16, "little"), block)
            if i == 3:
                print("ready", flush=True)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait(timeout=30)
    store = DiskStore(KVStoreSpec(big, "cpu", "00" * 16), str(tmp_path), None)
    files = sorted(tmp_path.glob("*.kvb"))
    assert len(files) >= 4
    out = torch.empty(big, dtype=torch.uint8)
    for f in files:
        assert store.load(bytes.fromhex(f.stem), out) and int(out.min()) == int(out.max()) == 7
    assert store.stats()["errors"] == 0


def test_corrupt_truncated_or_misnamed_files_are_counted_misses(tmp_path: Path) -> None:
    store = DiskStore(SPEC, str(tmp_path), None)
    for i in range(3):
        store.save(_key(i), _block(i))
    flipped = bytearray(block_path(tmp_path, _key(0)).read_bytes())
    flipped[HEADER_BYTES + 10] ^= 0xFF
    block_path(tmp_path, _key(0)).write_bytes(bytes(flipped))
    block_path(tmp_path, _key(1)).write_bytes(block_path(tmp_path, _key(1)).read_bytes()[:HEADER_BYTES + 17])
    os.replace(block_path(tmp_path, _key(2)), block_path(tmp_path, _key(7)))  # another block's bytes
    for i in (0, 1, 7):
        assert _loaded(store, _key(i)) is None
    assert store.stats()["errors"] == 3
    assert store.contains([_key(0)]) == 0  # a corrupt file is removed


def test_disk_store_evicts_the_least_recently_used_files_over_its_bytes(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + BLOCK
    store = DiskStore(SPEC, str(tmp_path), 4 * file_bytes)
    for i in range(4):
        store.save(_key(i), _block(i))
        old = 1_000_000 + i
        os.utime(block_path(tmp_path, _key(i)), (old, old))  # distinct ages: 0 oldest
    assert _loaded(store, _key(0)) is not None  # a load refreshes 0
    store.save(_key(4), _block(4))  # over 4 files: down to 90%, i.e. 3 files, oldest out first
    left = {int.from_bytes(bytes.fromhex(f.stem), "little") for f in tmp_path.glob("*.kvb")}
    assert left == {0, 3, 4}
    assert store.stats()["evictions"] == 2


def test_the_disk_store_needs_a_directory() -> None:
    plugin = Plugin(KVStoreConfig())
    with pytest.raises(ConfigError, match=r"plugins\.kv_store\.disk_dir is not set"):
        plugin.deepinfer_kv_stores()["disk"](SPEC)
    assert isinstance(plugin.deepinfer_kv_stores()["host"](SPEC), HostStore)
    assert plugin.deepinfer_stats()["host_blocks"] == 0
