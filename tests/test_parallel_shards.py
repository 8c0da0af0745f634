"""Each expert-parallel rank loads only its own routed experts (issue 9): the loader reads only the
held experts' tensors (counted through a patched ``safe_open``) and hands them to their rows, fused
stacks included; with 2 CPU ranks (gloo) on tiny DeepSeek-V3 and V4 checkpoints every rank's expert
tensors have only its slots' rows and hold exactly the checkpoint's tensors of the experts its
placement names — at start-up and after a forced rebalance — its load read only those, and the greedy
ids equal the single process's; dummy weights give every shard the rows of the full model; MTP layers
keep every expert, and a rank without the mtp drafter reads none of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_deepseek_v4 import SEQS
from test_deepseek_v4 import build as build_v4
from tiny_deepseek import random_prompts, save_tiny_v3

import deepinfer.model.loader as loader
from deepinfer import LLM, SamplingParams
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM, in_main_layer
from deepinfer.model.loader import LoadReport, iter_safetensors, read_hf_config
from deepinfer.parallel.moe import attach_expert_parallel
from deepinfer.parallel.placement import ExpertShard, initial_placement

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KV = 1 << 22
BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# 8 logical experts + 2 redundant over 2 ranks: rank 0 holds [0, 1, 2, 3, 4], rank 1 [5, 6, 7, 0, 1].
EPLB = {"enabled": True, "policy": "greedy_multistep", "interval": 4, "window": 4, "num_redundant_experts": 2}
SHARDS = [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]
# A routed expert's tensors: (MoE layer's decoder index, expert, projection) for V3 and V4 names.
EXPERT_NAME = re.compile(r"layers\.(\d+)\.(?:mlp|ffn)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
GATE, UP = ("gate_proj", "w1"), ("up_proj", "w3")


PROMPTS = random_prompts([5, 33, 17, 3, 26, 9], seed=11)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory) -> Path:
    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-shards"))


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-v4-shards")
    build_v4("v4-yarn", folder)
    return folder


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _expert_fingerprints(folder: Path) -> tuple[dict[tuple[int, int], tuple[float, float]], int, int]:
    """Per (MoE layer in forward order, logical expert): float64 sums of the checkpoint's w13 (gate rows
    then up rows) and w2; and the checkpoint's tensor count and bytes."""
    tensors = load_file(str(folder / "model.safetensors"))
    parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = EXPERT_NAME.search(name)
        if m:
            parts.setdefault((int(m.group(1)), int(m.group(2))), {})[m.group(3)] = t
    layers = sorted({layer for layer, _ in parts})
    out = {}
    for (layer, e), p in parts.items():
        gate = next(p[k] for k in GATE if k in p)
        up = next(p[k] for k in UP if k in p)
        down = p["down_proj"] if "down_proj" in p else p["w2"]
        w13 = torch.cat([gate, up]).float()
        out[layers.index(layer), e] = (float(w13.double().sum()), float(down.float().double().sum()))
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return out, len(tensors), total_bytes


def _expert_bytes(folder: Path, experts: set[int]) -> tuple[int, int]:
    """Tensors and bytes of the checkpoint's routed-expert tensors of logical ``experts``."""
    tensors = load_file(str(folder / "model.safetensors"))
    hits = [t for n, t in tensors.items() if (m := EXPERT_NAME.search(n)) and int(m.group(2)) in experts]
    return len(hits), sum(t.numel() * t.element_size() for t in hits)


def _check_shards(llm: LLM, folder: Path, slots: int) -> list[list[int]]:
    """Every rank: expert tensors of ``slots`` rows holding exactly the checkpoint's experts its
    placement names; returns the placement rows."""
    ref, _, _ = _expert_fingerprints(folder)
    layouts = llm.engine.expert_layout()
    rows = layouts[0]["placement"]
    for rank, layout in enumerate(layouts):
        assert layout["placement"] == rows
        assert layout["rows"] == [[slots, slots]] * len(rows)
        for layer, (row, held) in enumerate(zip(rows, layout["slots"], strict=True)):
            assert [e for e, _, _ in held] == row[rank * slots:(rank + 1) * slots]
            for e, w13_sum, w2_sum in held:
                assert (w13_sum, w2_sum) == ref[layer, e], (rank, layer, e)
    return rows


def _check_reads(llm: LLM, folder: Path) -> None:
    """Each rank's load read every tensor but the routed experts it does not hold."""
    _, tensors, total = _expert_fingerprints(folder)
    for rank, layout in enumerate(llm.engine.expert_layout()):
        skipped = set(range(8)) - set(SHARDS[rank])
        n, b = _expert_bytes(folder, skipped)
        assert layout["read"] == [tensors - n, total - b]


# ------------------------------------------------------------------------------------ in one process


def test_shard_experts_are_the_initial_placement_slots():
    for world, redundant, logical in [(2, 2, 8), (4, 0, 8), (3, 1, 5), (2, 6, 4)]:
        row = initial_placement(1, logical, ExpertShard(0, world, redundant).slots(logical) * world)[0].tolist()
        shards = [ExpertShard(r, world, redundant).experts(logical) for r in range(world)]
        assert [e for shard in shards for e in shard] == row
    assert [ExpertShard(r, 2, 2).experts(8) for r in range(2)] == SHARDS


def test_loader_reads_only_held_experts_renamed_to_their_rows(tiny_v3, monkeypatch):
    reads: list[str] = []

    class CountingFile:
        def __init__(self, *args, **kwargs):
            self.f = safe_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            reads.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", CountingFile)
    full = load_file(str(tiny_v3 / "model.safetensors"))
    held = [5, 6, 7, 0, 1, 5]  # a replica within the rank: expert 5 in rows 0 and 5
    # Layer 2 stands for an MTP layer: outside the shard, every expert read under its own name.
    report = LoadReport()
    got = list(iter_safetensors(tiny_v3, expert_ids=held, shards=lambda n: in_main_layer(n, 2), report=report))
    wanted = [n for n in full if not ((m := EXPERT_NAME.search(n)) and m.group(1) == "1"
                                      and int(m.group(2)) not in held)]
    assert sorted(reads) == sorted(wanted)  # each needed tensor read once, replicas included
    assert report.tensors == len(wanted)
    assert report.bytes == sum(full[n].numel() * full[n].element_size() for n in wanted)
    names = dict(got)
    assert len(got) == len(wanted) + 3  # the replica's 3 tensors come twice
    for row, e in enumerate(held):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.1.mlp.experts.{{}}.{proj}.weight"
            assert torch.equal(names[key.format(row)], full[key.format(e)])
    for e in range(8):
        key = f"model.layers.2.mlp.experts.{e}.down_proj.weight"
        assert torch.equal(names[key], full[key])


def test_loader_reads_held_rows_of_a_fused_stack(tmp_path):
    stack = torch.arange(8 * 4 * 3, dtype=torch.float32).view(8, 4, 3)
    save_file({"model.layers.0.mlp.experts.gate_up_proj": stack, "model.norm.weight": torch.ones(3)},
              str(tmp_path / "model.safetensors"))
    report = LoadReport()
    got = dict(iter_safetensors(tmp_path, expert_ids=[6, 1, 6], report=report))
    assert torch.equal(got["model.layers.0.mlp.experts.gate_up_proj"], stack[[6, 1, 6]])
    assert report.bytes == (3 * 4 * 3 + 3) * 4


def test_a_model_built_with_a_shard_allocates_and_loads_only_its_rows(tiny_v3):
    config = {**read_hf_config(tiny_v3), "deepinfer_expert_shard": ExpertShard(1, 2, 2)}
    model = DeepseekV3ForCausalLM(config, dtype=torch.float32, device=torch.device("cpu"), max_positions=64)
    moe = [m.mlp for m in model.layers if m.is_moe]
    assert model.expert_ids == SHARDS[1]
    assert all(m.w13.shape[0] == m.w2.shape[0] == 5 and m.expert_ids == SHARDS[1] for m in moe)
    loader.load_checkpoint(model, tiny_v3, torch.float32)
    ref, _, _ = _expert_fingerprints(tiny_v3)
    for layer, m in enumerate(moe):
        for row, e in enumerate(SHARDS[1]):
            assert (float(m.w13.data[row].double().sum()), float(m.w2.data[row].double().sum())) == ref[layer, e]


def test_mtp_layers_keep_every_expert_under_a_shard(tmp_path):
    """Drafting runs the MTP layers on each rank alone: their experts are loaded whole, under their own
    names, while the main layers hold the shard."""
    from test_deepseek_v3 import _build as build_v3
    from test_deepseek_v3_mtp import _mtp_checkpoint

    _mtp_checkpoint(build_v3("v3-yarn", tmp_path), tmp_path)
    hf = read_hf_config(tmp_path)
    shard = ExpertShard(1, 2, 0)
    held = shard.experts(hf["n_routed_experts"])
    model = DeepseekV3ForCausalLM({**hf, "deepinfer_expert_shard": shard}, dtype=torch.float32,
                                  device=torch.device("cpu"), max_positions=64)
    loader.load_checkpoint(model, tmp_path, torch.float32)
    tensors = {}
    for file in tmp_path.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    n, (mtp,) = hf["num_hidden_layers"], model.mtp_layers
    assert mtp.block.mlp.expert_ids == list(range(hf["n_routed_experts"]))
    for e in range(hf["n_routed_experts"]):
        assert torch.equal(mtp.block.mlp.w2.data[e], tensors[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"])
    layer = next(i for i, m in enumerate(model.layers) if m.is_moe)
    main = model.layers[layer].mlp
    assert main.w2.shape[0] == len(held)
    for row, e in enumerate(held):
        assert torch.equal(main.w2.data[row], tensors[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"])


def test_a_model_holding_every_expert_gives_up_the_others(tiny_v3):
    """A model that ignores the shard (e.g. a plugin's) still runs: ``attach_expert_parallel`` copies
    the rank's rows out of its full stacks."""
    model = DeepseekV3ForCausalLM(read_hf_config(tiny_v3), dtype=torch.float32, device=torch.device("cpu"),
                                  max_positions=64)
    loader.load_checkpoint(model, tiny_v3, torch.float32)
    full = [(m.mlp.w13.data.clone(), m.mlp.w2.data.clone()) for m in model.layers if m.is_moe]
    placement = initial_placement(2, 8, 10)
    layers = attach_expert_parallel(model, rank=1, world=2, slots=5, placement=placement, group=None)
    for ep, (w13, w2) in zip(layers, full, strict=True):
        assert ep.local_experts == SHARDS[1]
        assert torch.equal(ep.w13, w13[SHARDS[1]]) and torch.equal(ep.w2, w2[SHARDS[1]])


# ------------------------------------------------------------------------------------------- 2 ranks


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["v3", "v4"])
def test_two_ranks_load_only_their_experts_and_keep_them_through_a_rebalance(arch, tiny_v3, tiny_v4):
    folder = tiny_v3 if arch == "v3" else tiny_v4
    kw = {"kv_cache_bytes": KV, "block_size": BLOCK, "max_num_seqs": SEQS}
    single = LLM(folder, **kw)
    ref = _tokens(single)
    single.shutdown()
    with LLM(folder, expert_parallel_size=2, plugins={"eplb": EPLB}, **kw) as llm:
        initial = _check_shards(llm, folder, slots=5)
        assert initial[0] == [e for shard in SHARDS for e in shard]
        _check_reads(llm, folder)
        assert _tokens(llm) == ref
        llm.engine.rebalance()  # forced, on top of the ones due during the run
        assert llm.get_stats()["eplb"]["rebalances"] >= 2
        moved = _check_shards(llm, folder, slots=5)
        assert moved != initial
        assert _tokens(llm) == ref
        # one request: the other rank steps with placeholder forwards (a stateless, empty step)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[1:2], PARAMS, use_tqdm=False)] == ref[1:2]


@pytest.mark.distributed
def test_dummy_weights_of_a_shard_are_the_full_models_rows(tiny_v3):
    kw = {"kv_cache_bytes": KV, "block_size": BLOCK, "load_format": "dummy"}
    single = LLM(tiny_v3, **kw)
    ref = _tokens(single)
    moe = [m.mlp for m in single.engine.model.layers if m.is_moe]
    with LLM(tiny_v3, expert_parallel_size=2, **kw) as llm:
        for rank, layout in enumerate(llm.engine.expert_layout()):
            assert layout["rows"] == [[4, 4]] * len(moe) and layout["read"] is None
            for layer, held in enumerate(layout["slots"]):
                assert [e for e, _, _ in held] == [4 * rank + s for s in range(4)]
                for e, w13_sum, w2_sum in held:
                    assert w13_sum == float(moe[layer].w13.data[e].double().sum())
                    assert w2_sum == float(moe[layer].w2.data[e].double().sum())
        assert _tokens(llm) == ref
    single.shutdown()


@pytest.mark.distributed
def test_ranks_without_the_mtp_drafter_read_no_mtp_layer(tmp_path):
    """The MTP layers keep every expert on every rank for the mtp drafter only: without it a rank reads
    none of their tensors and holds no MTP weights, and its greedy ids are the single process's (which
    loads them, unused)."""
    from test_deepseek_v3 import _build as build_v3
    from test_deepseek_v3_mtp import _mtp_checkpoint

    _mtp_checkpoint(build_v3("v3-yarn", tmp_path), tmp_path)
    main = load_file(str(tmp_path / "model-00001-of-00002.safetensors"))  # the MTP layer is the other file
    kw = {"kv_cache_bytes": KV, "block_size": BLOCK}
    with LLM(tmp_path, **kw) as single:
        assert len(single.engine.model.mtp_layers) == 1
        ref = _tokens(single)
    with LLM(tmp_path, expert_parallel_size=2, **kw) as llm:
        layouts = llm.engine.expert_layout()
        assert _tokens(llm) == ref
    for rank, layout in enumerate(layouts):
        held = ExpertShard(rank, 2, 0).experts(8)
        read = [t for n, t in main.items() if not ((m := EXPERT_NAME.search(n)) and int(m.group(2)) not in held)]
        assert layout["read"] == [len(read), sum(t.numel() * t.element_size() for t in read)]
        assert layout["mtp_parameters"] == 0
