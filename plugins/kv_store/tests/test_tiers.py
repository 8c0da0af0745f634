"""KV tiers in an engine (issue 34): blocks evicted from the device prefix cache come back from the host
or disk store, the prefill computes only the tail, and greedy tokens equal a fresh computation."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deepseek_v4 import SEQS
from test_deepseek_v4 import build as build_v4
from test_gemma3 import build_gemma3
from tiny_deepseek import save_tiny_v3
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.kv.tiers import BlockCodec

BLOCK = 16
PREFIX = 64  # 4 full blocks shared by the prompts that hit
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiers-llama"))[1]


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_v3(tmp_path_factory.mktemp("tiers-v3"))


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiers-v4")
    build_v4("v4-yarn", folder, yoco_num_producer_layers=0)  # window 8, CSA ratio 4, HCA ratio 8
    return folder


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiers-gemma3")
    build_gemma3("gemma3-tied").save_pretrained(folder)  # sliding window 8 on two of three layers
    return folder


def _llm(folder: Path, kv_store: str | None, *, blocks: int, tmp: Path | None = None,
         more_plugins: dict[str, Any] | None = None, executor: str = "sync", **overrides: Any) -> LLM:
    """An engine whose device cache holds ``blocks`` blocks of 16 tokens (sized from the model's bytes), on the
    ``executor`` named (``overlap`` needs the scheduling plugin in ``more_plugins``)."""
    probe = LLM(folder, kv_cache_bytes=1 << 22, block_size=BLOCK, max_model_len=128, **overrides)
    pool = probe.engine.pool
    per_block = sum(t[0].numel() * t.element_size() for t in pool.paged)
    # Per-request state rings (DeepSeek-V4) come out of the same budget.
    state = sum(t.numel() * t.element_size() for layer in pool.layers for t in layer) - per_block * pool.num_blocks
    probe.shutdown()
    plugins = {"kv_store": {"enabled": True, "host_bytes": 1 << 24,
                            "disk_dir": str(tmp) if tmp is not None else None}, **(more_plugins or {})}
    return LLM(folder, kv_cache_bytes=state + per_block * (blocks + 1), block_size=BLOCK, max_model_len=128,
               cache={"kv_store": kv_store}, plugins=plugins, scheduler={"executor": executor}, **overrides)


def _count_computed(llm: LLM) -> list[int]:
    """Patch the scheduler so the returned list holds the tokens each step computes."""
    counts: list[int] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def counted() -> Any:
        out = schedule()
        counts.append(out.num_tokens)
        return out

    scheduler.schedule = counted
    return counts


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _evict_then_hit(folder: Path, kv_store: str, tmp: Path | None = None,
                    more_plugins: dict[str, Any] | None = None, executor: str = "sync",
                    **overrides: Any) -> dict[str, Any]:
    """Prompt A (prefix + tail), then unrelated prompts that evict every cached block of A, then prompt B
    (the same prefix, another tail): B's prefix must come back from the tiers."""
    prefix = _tokens(PREFIX, 1)
    a, b = prefix + _tokens(9, 2), prefix + _tokens(13, 3)
    fillers = [_tokens(70, 10 + i) for i in range(3)]
    llm = _llm(folder, kv_store, blocks=12, tmp=tmp, more_plugins=more_plugins, executor=executor, **overrides)
    first = _generate(llm, [a])
    for filler in fillers:
        _generate(llm, [filler])
    llm.engine.kv_tiers.flush()
    assert all(llm.engine.kv.pool.lookup(h) is None for h in llm.engine.kv._chain("x", a, PREFIX // BLOCK)), \
        "the fillers must evict the prefix from the device"
    llm.engine.kv.hashes.pop("x")
    counts = _count_computed(llm)
    second = _generate(llm, [b])
    stats = llm.get_stats()
    held = [dict(getattr(store, "held", {})) for store in llm.engine.kv_tiers.stores]
    llm.shutdown()
    fresh = LLM(folder, kv_cache_bytes=1 << 22, block_size=BLOCK, max_model_len=128,
                cache={"prefix_caching": False}, **overrides)
    want = _generate(fresh, [a, b])
    fresh.shutdown()
    return {"got": first + second, "want": want, "prefill": counts[0], "len_b": len(b), "stats": stats,
            "held": held}


@pytest.mark.parametrize("kv_store", ["host", "disk", "host+disk"])
def test_a_prefix_evicted_from_the_device_comes_back_from_each_tier(llama_dir: Path, tmp_path: Path,
                                                                   kv_store: str) -> None:
    run = _evict_then_hit(llama_dir, kv_store, tmp_path)
    assert run["got"] == run["want"]
    assert run["prefill"] == run["len_b"] - PREFIX  # only the tail is computed
    tiers = run["stats"]["kv_tiers"]
    assert tiers["promoted_blocks"] == PREFIX // BLOCK and tiers["promoted_tokens"] == PREFIX
    assert tiers["demoted_blocks"] > 0 and tiers["load_failures"] == 0
    assert run["stats"]["kv_blocks_free"] == run["stats"]["kv_blocks_total"]
    assert all(not held for held in run["held"])  # the host store's lent blocks are given back


@pytest.mark.gpu
@pytest.mark.parametrize("kv_store", ["host", "host+disk"])
def test_a_prefix_comes_back_from_the_host_on_cuda(llama_dir: Path, tmp_path: Path, kv_store: str) -> None:
    """On CUDA: pinned slab, side-stream demotion, promotion straight from the slab through a device staging
    matrix scattered by one indexed copy per cache tensor."""
    run = _evict_then_hit(llama_dir, kv_store, tmp_path, device="cuda", dtype="float32")
    assert run["got"] == run["want"]
    assert run["prefill"] == run["len_b"] - PREFIX
    assert run["stats"]["kv_tiers"]["promoted_blocks"] == PREFIX // BLOCK
    assert run["stats"]["kv_blocks_free"] == run["stats"]["kv_blocks_total"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_scattered_staging_matrix_equals_block_by_block_unpacking(device: str) -> None:
    """``BlockCodec.scatter`` of packed blocks (mixed dtypes, odd sizes, padded rows) writes what ``unpack``
    writes, block by block, and touches no other block."""
    gen = torch.Generator().manual_seed(0)
    shapes = [((9, 3, 5), torch.bfloat16), ((9, 7), torch.uint8), ((9, 2, 3), torch.float32)]
    source = [torch.randn(s, generator=gen).to(d) if d != torch.uint8 else torch.randint(0, 256, s, generator=gen,
              dtype=d) for s, d in shapes]
    codec = BlockCodec(source)
    assert codec.stride % 64 == 0 and codec.stride >= codec.nbytes
    packed = []
    for b in (4, 1, 7):
        buffer = torch.empty(codec.nbytes, dtype=torch.uint8)
        codec.pack(b, buffer)
        packed.append(buffer)
    one_by_one = [torch.zeros_like(t) for t in source]
    by_block = BlockCodec(one_by_one)
    for buffer, b in zip(packed, (2, 8, 5), strict=True):
        by_block.unpack(buffer, b)
    scattered = [torch.zeros_like(t, device=device) for t in source]
    staging = torch.zeros((3, codec.stride), dtype=torch.uint8, device=device)
    for row, buffer in zip(staging, packed, strict=True):
        row[:codec.nbytes].copy_(buffer)
    BlockCodec(scattered).scatter(staging, torch.tensor([2, 8, 5], device=device))
    for want, got in zip(one_by_one, scattered, strict=True):
        assert torch.equal(want, got.cpu())


class _Copies:
    """A stand-in for a CUDA event: the device copies it marks are done once ``done`` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_lent_host_blocks_are_held_until_their_copies_are_done() -> None:
    """A promotion reads the host store in place; the blocks stay held (no save may evict them) while its
    copies are in flight, and are given back at the next promotion or write after the copies' event passes."""
    from deepinfer_kv_store.host import HostStore

    from deepinfer.interfaces import KVStoreSpec
    from deepinfer.kv.tiers import KVTiers

    cache = [torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)]
    codec = BlockCodec(cache)
    spec = KVStoreSpec(block_bytes=codec.nbytes, device="cpu", namespace="00" * 16)
    store = HostStore(spec, capacity_bytes=2 * codec.nbytes)
    tiers = KVTiers([store], codec, spec, torch.device("cpu"))
    hashes = [bytes([i]) * 16 for i in range(3)]
    for block_id, h in zip((1, 2), hashes, strict=False):
        tiers.save_block(block_id, h, wait=True)
    tiers.flush()
    copies = _Copies()

    def copy_in(buffers: list[torch.Tensor], block_ids: list[int]) -> _Copies:  # copied, but marked in flight
        KVTiers._copy_in(tiers, buffers, block_ids)
        return copies

    tiers._copy_in = copy_in
    assert tiers.load(hashes[:2], [4, 5]) == 2
    assert torch.equal(cache[0][4], cache[0][1]) and torch.equal(cache[0][5], cache[0][2])
    assert sorted(store.held) == sorted(tiers.key(h) for h in hashes[:2])
    tiers.save_block(3, hashes[2], wait=True)
    tiers.flush()
    assert store.stats()["errors"] == 1 and store.contains([tiers.key(hashes[2])]) == 0  # both slots held: refused
    assert len(store.held) == 2  # the writer's release found the copies still in flight
    copies.done = True
    tiers.save_block(3, hashes[2], wait=True)
    tiers.flush()  # refused again (the write comes before the writer's release), then both given back
    assert not store.held and store.stats()["errors"] == 2
    tiers.save_block(3, hashes[2], wait=True)
    tiers.flush()
    assert store.contains([tiers.key(hashes[2])]) == 1
    tiers.close()


def test_tiers_under_the_overlapped_executor(llama_dir: Path) -> None:
    """The overlapped executor (plugins/scheduling: the forward on a worker thread) demotes and promotes
    the same blocks with the same tokens."""
    run = _evict_then_hit(llama_dir, "host", more_plugins={"scheduling": {"enabled": True}}, executor="overlap")
    assert run["got"] == run["want"]
    assert run["stats"]["kv_tiers"]["promoted_blocks"] == PREFIX // BLOCK
    assert run["stats"]["kv_blocks_free"] == run["stats"]["kv_blocks_total"]


@pytest.mark.slow  # about 30 s on the 2-core VM (three engines of a MoE model)
def test_the_latent_cache_of_deepseek_v3_comes_back_from_the_host(v3_dir: Path) -> None:
    run = _evict_then_hit(v3_dir, "host")
    assert run["got"] == run["want"]
    assert run["prefill"] == run["len_b"] - PREFIX


def test_a_sliding_window_model_comes_back_from_the_host(gemma_dir: Path) -> None:
    run = _evict_then_hit(gemma_dir, "host")
    assert run["got"] == run["want"]
    assert run["prefill"] == run["len_b"] - PREFIX


def test_deepseek_v4_paged_entries_come_back_and_replay_rebuilds_its_state(v4_dir: Path,
                                                                           one_torch_thread: None) -> None:
    """Compressed entries and indexer keys come back from the host store; the state rings are not stored,
    so exact replay recomputes the receptive field below the hit (as after a device hit): the prefill
    computes the tail plus that field, not the whole prefix."""
    run = _evict_then_hit(v4_dir, "host", max_num_seqs=SEQS)
    assert run["got"] == run["want"]
    field = 4 * (8 + 1) + 2 * 8  # layers x (window + max_backtrack) + 2 x the largest ratio (ExactReplayPlanner)
    assert run["prefill"] == run["len_b"] - PREFIX + field
    assert run["stats"]["kv_tiers"]["promoted_blocks"] == PREFIX // BLOCK


def test_a_lower_tier_hit_is_copied_into_the_tier_above(llama_dir: Path, tmp_path: Path) -> None:
    """Blocks only on disk (a second engine on the directory, whose host store is empty) are promoted to
    the device and copied into its host store on the way."""
    first = _evict_then_hit(llama_dir, "disk", tmp_path)
    assert first["stats"]["kv_tiers"]["disk"]["saves"] > 0
    prefix = _tokens(PREFIX, 1)
    llm = _llm(llama_dir, "host+disk", blocks=12, tmp=tmp_path)
    counts = _count_computed(llm)
    got = _generate(llm, [prefix + _tokens(13, 3)])
    tiers = llm.get_stats()["kv_tiers"]
    llm.shutdown()
    assert got == first["want"][1:]
    assert counts[0] == 13 + PREFIX - PREFIX
    assert tiers["disk"]["hits"] == PREFIX // BLOCK and tiers["host"]["saves"] >= PREFIX // BLOCK


def test_blocks_of_another_model_are_never_found(llama_dir: Path, tmp_path: Path) -> None:
    """The key carries the model identity and cache layout: the same tokens under another model dtype miss."""
    _evict_then_hit(llama_dir, "disk", tmp_path)
    llm = _llm(llama_dir, "disk", blocks=12, tmp=tmp_path, dtype="bfloat16")
    counts = _count_computed(llm)
    prompt = _tokens(PREFIX, 1) + _tokens(13, 3)
    _generate(llm, [prompt])
    tiers = llm.get_stats()["kv_tiers"]
    llm.shutdown()
    assert counts[0] == len(prompt) and tiers["promoted_blocks"] == 0


def test_corrupt_block_files_are_misses_and_the_tokens_stay_right(llama_dir: Path, tmp_path: Path) -> None:
    run = _evict_then_hit(llama_dir, "disk", tmp_path)
    for f in tmp_path.glob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    llm = _llm(llama_dir, "disk", blocks=12, tmp=tmp_path)
    counts = _count_computed(llm)
    prompt = _tokens(PREFIX, 1) + _tokens(13, 3)
    engine = llm.engine
    engine.add(engine.make_request(prompt, GREEDY))
    engine.kv_tiers.wait_prefetch()  # the read-ahead finds the corrupt block (and removes it) first
    got = []
    while engine.has_unfinished():
        got += [o.outputs[0].token_ids for o in engine.step()]
    tiers = llm.get_stats()["kv_tiers"]
    llm.shutdown()
    assert got == run["want"][1:]
    assert counts[0] == len(prompt)
    assert tiers["load_failures"] == 1 and tiers["disk"]["errors"] == 1


def test_a_store_that_raises_mid_promotion_is_a_miss_and_leaks_nothing(llama_dir: Path) -> None:
    """The third block's load raises (a broken store): the promotion stops after two blocks, the rest is
    computed, the tokens are right and every block comes back."""
    prefix = _tokens(PREFIX, 1)
    a, b = prefix + _tokens(9, 2), prefix + _tokens(13, 3)
    llm = _llm(llama_dir, "host", blocks=12)
    _generate(llm, [a])
    for i in range(3):
        _generate(llm, [_tokens(70, 10 + i)])
    llm.engine.kv_tiers.flush()
    store = llm.engine.kv_tiers.stores[0]
    view, calls = store.view, []  # a promotion reads the host store in place

    def broken(key: bytes) -> torch.Tensor | None:
        calls.append(key)
        if len(calls) == 3:
            raise OSError("device unplugged")
        return view(key)

    store.view = broken
    counts = _count_computed(llm)
    got = _generate(llm, [b])
    stats, held = llm.get_stats(), dict(store.held)
    llm.shutdown()
    fresh = LLM(llama_dir, kv_cache_bytes=1 << 22, block_size=BLOCK, max_model_len=128)
    assert got == _generate(fresh, [b])
    fresh.shutdown()
    assert counts[0] == len(b) - 2 * BLOCK
    assert stats["kv_tiers"]["promoted_blocks"] == 2 and stats["kv_tiers"]["load_failures"] == 1
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not held  # the two views given back


@pytest.mark.parametrize("executor", ["sync", "overlap"])
def test_aborts_and_preemptions_with_tiers_leak_no_block(llama_dir: Path, executor: str) -> None:
    overlap = {"scheduling": {"enabled": True}} if executor == "overlap" else None
    llm = _llm(llama_dir, "host", blocks=10, max_num_seqs=6, more_plugins=overlap, executor=executor)
    engine = llm.engine
    # Whether a demoted prefix comes back depends on the schedule: a seed whose sync run promotes with
    # in-step prefix sharing on (which keeps more of the shared prefix on the device).
    rng = random.Random(9)
    shared = _tokens(32, 7)
    prompts = [(shared if i % 2 else []) + _tokens(rng.randint(5, 40), 100 + i) for i in range(30)]
    requests = [engine.make_request(p, SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 30), seed=i))
                for i, p in enumerate(prompts)]
    for req in requests:
        engine.add(req)
    finished: set[str] = set()
    while engine.has_unfinished():
        finished |= {out.request_id for out in engine.step()}
        if rng.random() < 0.3:
            live = [r.request_id for r in requests if r.request_id not in finished and not r.finished]
            if live:
                assert engine.abort(rng.choice(live))
    stats = llm.get_stats()
    llm.shutdown()
    assert finished == {r.request_id for r in requests}
    assert stats["preemptions"] > 0 and stats["kv_tiers"]["demoted_blocks"] > 0
    if executor == "sync":  # this schedule promotes; the overlapped one's timing keeps its prefixes on the device
        assert stats["kv_tiers"]["promoted_blocks"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_an_unknown_or_malformed_store_chain_is_an_error(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"cache\.kv_store: unknown store 'redis'; offered: disk \(plugin "
                                          r"kv_store\), host \(plugin kv_store\)"):
        LLM(llama_dir, kv_cache_bytes=1 << 20, block_size=BLOCK, cache={"kv_store": "host+redis"},
            plugins={"kv_store": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"cache\.kv_store: 'host\+host' must be store names joined by '\+'"):
        LLM(llama_dir, kv_cache_bytes=1 << 20, block_size=BLOCK, cache={"kv_store": "host+host"},
            plugins={"kv_store": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"cache\.prefix_caching is false"):
        LLM(llama_dir, kv_cache_bytes=1 << 20, block_size=BLOCK,
            cache={"kv_store": "host", "prefix_caching": False}, plugins={"kv_store": {"enabled": True}})


@pytest.mark.slow  # starts two rank processes (about 10 s)
@pytest.mark.distributed
def test_a_parallel_run_with_a_store_is_refused(llama_dir: Path) -> None:
    from deepinfer.parallel.driver import ParallelEngine

    with pytest.raises(ConfigError, match=r"cache\.kv_store='host': KV tiers run on one rank only"):
        ParallelEngine(str(llama_dir), overrides={
            "cache": {"kv_store": "host", "kv_cache_bytes": 1 << 20, "block_size": BLOCK},
            "plugins": {"kv_store": {"enabled": True}}, "parallel": {"data_parallel_size": 2}})



@pytest.mark.parametrize("kv_store", ["disk", "host+disk"])
def test_a_queued_requests_disk_blocks_are_read_ahead(llama_dir: Path, tmp_path: Path, kv_store: str) -> None:
    """Blocks only on disk are read on the tiers' reader thread as soon as a request is queued (into the
    host store when there is one, else into the tiers' staging area); its admission then promotes them from
    memory, reading the disk no more, computes only the tail and gives the right tokens."""
    first = _evict_then_hit(llama_dir, "disk", tmp_path)
    llm = _llm(llama_dir, kv_store, blocks=12, tmp=tmp_path)
    engine, tiers = llm.engine, llm.engine.kv_tiers
    engine.add(engine.make_request(_tokens(PREFIX, 1) + _tokens(13, 3), GREEDY))
    tiers.wait_prefetch()
    disk_hits = tiers.stats()["disk"]["hits"]
    assert tiers.stats()["prefetched_blocks"] == PREFIX // BLOCK == disk_hits
    counts = _count_computed(llm)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    stats = llm.get_stats()
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == first["want"][1:]
    assert counts[0] == 13
    tier_stats = stats["kv_tiers"]
    assert tier_stats["disk"]["hits"] == disk_hits and tier_stats["promoted_blocks"] == PREFIX // BLOCK
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_request_whose_blocks_no_tier_holds_reads_nothing_ahead(llama_dir: Path, tmp_path: Path) -> None:
    llm = _llm(llama_dir, "disk", blocks=12, tmp=tmp_path)
    engine, tiers = llm.engine, llm.engine.kv_tiers
    engine.add(engine.make_request(_tokens(PREFIX + 5, 7), GREEDY))
    tiers.wait_prefetch()
    stats = tiers.stats()
    llm.shutdown()
    assert stats["prefetched_blocks"] == 0 and stats["disk"]["misses"] == 0
