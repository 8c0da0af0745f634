"""DeepSeek-V3 beyond the main forward: float32 router parameters survive a bf16 load, the MTP layer
against transformers' ``MtpModel``, router statistics, and rolling back computed tokens on the latent
cache. Tiny random configs on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from test_deepseek_v3 import V3_BASE, _build, _prompts
from transformers.modeling_layers import MtpModel

from deepinfer import LLM, SamplingParams
from deepinfer.interfaces import ForwardContext
from deepinfer.kv.pools import KVPool

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16




def _ctx(llm: LLM, start: int, end: int, table: list[int]) -> ForwardContext:
    """One request computing positions ``[start, end)`` over blocks ``table``."""
    n = end - start
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
    return ForwardContext(
        positions=torch.arange(start, end), slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([end]),
        block_tables=torch.tensor([table]), num_decodes=int(n == 1), query_start_loc_host=[0, n],
        seq_lens_host=[end], block_size=BLOCK, backends=llm.engine.runner.backends)


# ------------------------------------------------------------------------------ float32 router


def test_fp32_router_parameters_stay_exact_in_a_bf16_model(tmp_path):
    ref = _build("v3-yarn", tmp_path)  # saved in float32
    llm = LLM(tmp_path, kv_cache_bytes=1 << 22, block_size=BLOCK, dtype="bfloat16")
    model = llm.engine.model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    for i in (1, 2):
        ours, theirs = model.layers[i].mlp, ref.model.layers[i].mlp.gate
        assert ours.e_score_correction_bias.dtype == ours.gate_weight.dtype == torch.float32
        assert torch.equal(ours.e_score_correction_bias, theirs.e_score_correction_bias)
        assert torch.equal(ours.gate_weight, theirs.weight)
        # A bf16 cast would have lost bits of these random float32 values.
        assert not torch.equal(theirs.e_score_correction_bias.bfloat16().float(), theirs.e_score_correction_bias)


# ------------------------------------------------------------------------------ MTP


def _mtp_checkpoint(main: torch.nn.Module, folder: Path, seed: int = 7) -> MtpModel:
    """A random ``MtpModel`` over ``main``, saved under the published checkpoint names
    (``model.layers.{N}.*``, per-expert tensors, ``shared_head.norm``) next to the main weights."""
    n = main.config.num_hidden_layers
    mtp = MtpModel(main, num_mtp_layers=1).eval()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, p in mtp.state_dict().items():
            if name in ("embed_tokens.weight", "shared_head.weight"):
                continue  # the main model's, shared
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        inter = main.config.moe_intermediate_size
        for name, p in mtp.state_dict().items():
            _, _, rest = name.partition("layers.0.")
            key = f"model.layers.{n}."
            if name == "embed_tokens.weight":
                tensors[key + "embed_tokens.weight"] = p.clone()
            elif name == "shared_head.weight":
                tensors[key + "shared_head.head.weight"] = p.clone()
            elif rest == "post_norm.weight":
                tensors[key + "shared_head.norm.weight"] = p.clone()
            elif rest.endswith("mlp.experts.gate_up_proj"):
                for e in range(p.shape[0]):
                    tensors[f"{key}mlp.experts.{e}.gate_proj.weight"] = p[e, :inter].clone()
                    tensors[f"{key}mlp.experts.{e}.up_proj.weight"] = p[e, inter:].clone()
            elif rest.endswith("mlp.experts.down_proj"):
                for e in range(p.shape[0]):
                    tensors[f"{key}mlp.experts.{e}.down_proj.weight"] = p[e].clone()
            else:
                tensors[key + rest.removeprefix("mtp_block.")] = p.clone()
    # Two shards and an index, as the published checkpoints have (transformers reads a lone
    # model.safetensors and nothing else).
    main_file, mtp_file = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    (folder / "model.safetensors").rename(folder / main_file)
    save_file(tensors, str(folder / mtp_file))
    with safe_open(str(folder / main_file), framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), main_file)
    weight_map.update(dict.fromkeys(tensors, mtp_file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return mtp


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v3-mtp")
    main = _build("v3-yarn", folder)
    return main, _mtp_checkpoint(main, folder), folder


def test_mtp_checkpoint_names_are_the_ones_transformers_loads(with_mtp):
    """transformers' own MTP loader (``MtpModel.from_pretrained``) reads our file back exactly; its
    pattern for DeepSeek-V3 names layer 61, so point it at this tiny model's layer 3."""
    main, mtp, folder = with_mtp
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(folder).eval()
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{main.config.num_hidden_layers}.*"]
    again = MtpModel.from_pretrained(loaded)
    ours, theirs = mtp.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name


def test_mtp_logits_match_transformers(with_mtp):
    main, mtp, folder = with_mtp
    llm = LLM(folder, kv_cache_bytes=1 << 22, block_size=BLOCK)
    model = llm.engine.model
    assert len(model.mtp_layers) == 1
    assert len(model.cache_specs()) == main.config.num_hidden_layers  # MTP's cache is the drafter's
    mtp_pool = KVPool(model.mtp_cache_specs(), llm.engine.pool.num_blocks, BLOCK, torch.float32,
                      torch.device("cpu"))
    model.bind_mtp_cache(mtp_pool.layers)

    seq = 21
    ids = torch.tensor(_prompts([seq], seed=11)[0])
    with torch.no_grad():
        hf_hidden = main(ids[None], output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(seq - 1)[None]  # the hidden's positions, as deepinfer uses them
        cache = transformers.cache_utils.MtpCache(config=main.config.get_mtp_config())
        ref_hidden = mtp.forward_layer(0, hf_hidden[:, :-1], positions, cache, input_ids=ids[None, 1:])
        ref = mtp._project_to_logits(ref_hidden)[0]  # [seq - 1, V]
        # The documented call gives the last row too (the drafted token's logits).
        _, last, _ = mtp(input_ids=ids[None, 1:], last_hidden_states=hf_hidden[:, :-1], attention_mask=None,
                         position_ids=positions,
                         mtp_cache=transformers.cache_utils.MtpCache(config=main.config.get_mtp_config()))
    assert torch.allclose(last[0, -1], ref[-1], atol=1e-5)

    # Main model and MTP over the same paging: a 12-token prefill chunk, then one token at a time.
    table = [1, 2]
    rows = []
    with torch.inference_mode():
        for lo, hi in [(0, 12), *((p, p + 1) for p in range(12, seq - 1))]:
            ctx = _ctx(llm, lo, hi, table)
            hidden = model.forward(ids[lo:hi], ctx)
            rows.append(model.mtp_forward(hidden, ids[lo + 1:hi + 1], ctx.positions, ctx))
    ours = torch.cat(rows)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"max |Δ| {err}"


def test_incomplete_mtp_weights_are_dropped(tmp_path):
    _build("v3-yarn", tmp_path)
    n = V3_BASE["num_hidden_layers"]
    save_file({f"model.layers.{n}.enorm.weight": torch.ones(64),
               f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128)}, str(tmp_path / "mtp.safetensors"))
    llm = LLM(tmp_path, kv_cache_bytes=1 << 22, block_size=BLOCK)
    assert len(llm.engine.model.mtp_layers) == 0 and llm.engine.model.mtp_cache_specs() == []


# ------------------------------------------------------------------------------ router statistics


def test_router_stats_count_every_routed_token(tmp_path):
    _build("v3-noqlora", tmp_path)  # every layer MoE, top-3
    llm = LLM(tmp_path, kv_cache_bytes=1 << 22, block_size=BLOCK)
    model = llm.engine.model
    top_k = json.loads((tmp_path / "config.json").read_text())["num_experts_per_tok"]
    assert model.router_stats.shape == (3, 8) and model.router_stats.dtype == torch.int64
    model.take_router_stats()

    ids = torch.tensor(_prompts([29], seed=6)[0])
    chosen = {}
    hooks = [layer.mlp.register_forward_hook(
        lambda mod, args, out, i=i: chosen.__setitem__(i, mod.route(args[0], args[1])[0]))
        for i, layer in enumerate(model.layers)]
    with torch.inference_mode():
        model.forward(ids, _ctx(llm, 0, len(ids), [1, 2]))
    for h in hooks:
        h.remove()
    stats = model.take_router_stats()
    assert torch.equal(stats.sum(dim=1), torch.full((3,), len(ids) * top_k))
    for row, layer in enumerate(model.moe_layer_ids):
        assert torch.equal(stats[row], torch.bincount(chosen[layer].reshape(-1), minlength=8))
    assert model.router_stats.sum() == 0  # taken

    # Through the engine: StepStats.router_loads per step, summing to the step's tokens × top_k.
    # (the engine installs this callback when a plugin observes deepinfer_step_end)
    loads = []
    llm.engine.core.on_step_end = lambda stats: loads.append(
        (stats.num_prefill_tokens + stats.num_decode_tokens, stats.router_loads))
    llm.generate(_prompts([5, 17], seed=8), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert loads
    for tokens, step in loads:
        assert torch.equal(step.sum(dim=1), torch.full((3,), tokens * top_k))


# ------------------------------------------------------------------------------ rollback


def test_rolling_back_computed_tokens_gives_bitwise_the_same_logits(tmp_path):
    """Compute k draft tokens past a prefix, roll back (recompute from the prefix's end), then feed
    the true next token: its logits equal, bit for bit, those of a run that never saw the drafts."""
    _build("v3-yarn", tmp_path)
    llm = LLM(tmp_path, kv_cache_bytes=1 << 22, block_size=BLOCK)
    model = llm.engine.model
    prompt = torch.tensor(_prompts([30], seed=9)[0])
    drafts = torch.tensor(_prompts([5], seed=10)[0])
    nxt = torch.tensor([17])
    with torch.inference_mode():
        def run(table, feed_drafts):
            model.forward(prompt, _ctx(llm, 0, 30, table))
            if feed_drafts:  # 5 drafts at positions 30..34: a decode step, then a 4-token chunk
                model.forward(drafts[:1], _ctx(llm, 30, 31, table))
                model.forward(drafts[1:], _ctx(llm, 31, 35, table))
            # num_computed back to 30: position 30 gets the true token
            ctx = _ctx(llm, 30, 31, table)
            return model.compute_logits(model.forward(nxt, ctx), ctx)

        clean = run([1, 2, 3], feed_drafts=False)
        rolled = run([4, 5, 6], feed_drafts=True)
        # Same blocks as the clean run (now holding draft rows past position 30), as a real rollback.
        rolled_same_blocks = run([1, 2, 3], feed_drafts=True)
    assert torch.equal(clean, rolled)
    assert torch.equal(clean, rolled_same_blocks)
