"""The ``dspark`` drafter with MoE blocks, and on DeepSeek-V4 and V4.1 targets.

MoE blocks: one block's forward equals a plain-torch computation written out here (RMSNorm, RoPE, the
attention over the context window and the block, the shared expert and the routed experts token by
token); greedy outputs with a MoE-block drafter equal no speculation on tiny Llama and DeepSeek-V3;
the MoE fields are checked. DeepSeek-V4: the captured features are the means of transformers' streams
entering each target layer (and its final streams); V4 and V4.1: after every step of a chunked, batched
run with accepted and rejected drafts, the context window the drafter reads equals ``context_kv`` of
features recomputed from scratch, greedy outputs equal no speculation, and every block and state slot is
back at the end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from deepinfer_spec_decode.config import SpecDecodeConfig
from deepinfer_spec_decode.dspark import DSparkDrafter, DSparkNetwork
from test_deepseek_v4 import build as build_v4
from test_deepseek_v4 import make_llm
from test_deepseek_v41 import ENGRAM, build_v41
from test_dspark import _dspark, _generate, _llm, _prompts, _spec, check_window_and_plant, llama_dir, tiny_dir  # noqa: F401 (fixtures)

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
MOE = {"dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2}


# ------------------------------------------------------------------------------------------- MoE blocks


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, position: int) -> torch.Tensor:
    """RoPE of one head vector ``x [d]`` at ``position`` (halves layout, theta 10,000)."""
    half = x.shape[0] // 2
    out = torch.empty_like(x)
    for j in range(half):
        angle = position * 10000.0 ** (-j / half)
        c, s = math.cos(angle), math.sin(angle)
        out[j] = x[j] * c - x[j + half] * s
        out[j + half] = x[j + half] * c + x[j] * s
    return out


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (gate_up @ x).chunk(2)
    return down @ (gate * torch.sigmoid(gate) * up)


def _block_from_scratch(layer, x: torch.Tensor, context: torch.Tensor, visible: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """One block, row by row and head by head: ``x [B, k, H]``, ``context [B, W, 2, H]``, ``visible [B, W]``."""
    batch, k, hidden = x.shape
    heads, head_dim = layer.heads, hidden // layer.heads
    out = torch.empty_like(x)
    wq, wk, wv = layer.qkv.weight.chunk(3)
    moe = layer.moe
    for b in range(batch):
        normed = [_rms(x[b, i], layer.attn_norm.weight) for i in range(k)]
        keys, values = [], []  # per visible key: [H] (per head sliced below)
        for w in range(context.shape[1]):
            if visible[b, w]:
                keys.append(context[b, w, 0])
                values.append(context[b, w, 1])
        for i in range(k):
            pos = int(positions[b, i])
            keys.append(torch.cat([_rotate(h, pos) for h in (wk @ normed[i]).split(head_dim)]))
            values.append(wv @ normed[i])
        for i in range(k):
            q = torch.cat([_rotate(h, int(positions[b, i])) for h in (wq @ normed[i]).split(head_dim)])
            attn = []
            for h in range(heads):
                sl = slice(h * head_dim, (h + 1) * head_dim)
                scores = torch.stack([q[sl] @ key[sl] for key in keys]) / math.sqrt(head_dim)
                probs = torch.softmax(scores, dim=0)
                attn.append(sum(p * v[sl] for p, v in zip(probs, values, strict=True)))
            y = x[b, i] + layer.o.weight @ torch.cat(attn)
            m = _rms(y, layer.mlp_norm.weight)
            mlp = _swiglu(m, layer.gate_up.weight, layer.down.weight)
            scores = torch.sqrt(F.softplus(moe.router.weight @ m))
            chosen = sorted(range(scores.shape[0]), key=lambda e: -float(scores[e] + moe.router_bias[e]))[:moe.top_k]
            total = sum(float(scores[e]) for e in chosen)
            for e in chosen:
                mlp = mlp + float(scores[e]) / total * _swiglu(m, moe.experts_gate_up[e], moe.experts_down[e])
            out[b, i] = y + mlp
    return out


def test_a_moe_block_equals_a_from_scratch_computation():
    torch.manual_seed(0)
    network = DSparkNetwork(16, 2, VOCAB, num_layers=2, heads=2, intermediate=8, markov_rank=4, dtype=torch.float64,
                            device=torch.device("cpu"), experts=4, experts_per_token=2)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    batch, k, window = 3, 4, 5
    x = torch.randn(batch, k, 16, dtype=torch.float64)
    positions = torch.tensor([[0], [6], [11]]) + torch.arange(k)
    # Window rows: the request at position 0 has none, the one at 6 all five, the one at 11 all five.
    visible = torch.tensor([[False] * 5, [True] * 5, [True] * 5])
    features = torch.randn(batch, window, 32, dtype=torch.float64)
    window_pos = (positions[:, :1] - window + torch.arange(window)).clamp_min(0)
    context = network.context_kv(features.flatten(0, 1), window_pos.flatten()).unflatten(0, (batch, window))
    with torch.no_grad():
        ours = network.layers[0](x, context[:, :, 0], visible, positions)
        expected = _block_from_scratch(network.layers[0], x, context[:, :, 0], visible, positions)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)  # RoPE angles are float32
        # Rows do route to different experts (the test would not see a routing mix-up otherwise).
        ids, _ = network.layers[0].moe.route(_rms(x, network.layers[0].mlp_norm.weight).flatten(0, 1))
        assert ids.unique().numel() > 2
        before, _ = network.block(context, visible, x, positions)
        second = _block_from_scratch(network.layers[1], expected, context[:, :, 1], visible, positions)
        torch.testing.assert_close(before, second, rtol=1e-5, atol=1e-5)  # RoPE angles are float32


def test_greedy_tokens_are_identical_with_a_moe_block_drafter(tiny_dir):  # noqa: F811 (the imported fixture)
    prompts = _prompts(5, 11)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(5)]
    reference, _ = _generate(tiny_dir, prompts, params)
    for plan in ("fixed", "varlen"):
        out, llm = _generate(tiny_dir, prompts, params, _spec(plan, dspark_num_layers=2, **MOE))
        assert out == reference, plan
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["spec_decode"]["verify_steps"] > 0
        assert all(layer.moe is not None and layer.moe.experts_gate_up.shape[0] == 4
                   for layer in _dspark(llm).network.layers)


def test_moe_fields_are_checked(llama_dir):  # noqa: F811 (the imported fixture)
    with pytest.raises(ValueError, match="dspark_num_experts_per_tok must be set"):
        SpecDecodeConfig(dspark_n_routed_experts=4)
    with pytest.raises(ValueError, match="needs dspark_n_routed_experts"):
        SpecDecodeConfig(dspark_num_experts_per_tok=2)
    with pytest.raises(ValueError, match="at most dspark_n_routed_experts"):
        SpecDecodeConfig(dspark_n_routed_experts=2, dspark_num_experts_per_tok=3)
    with pytest.raises(ValueError, match="dspark_target_attn_input must be true"):
        SpecDecodeConfig(dspark_target_attn_input=False)
    with pytest.raises(ConfigError, match="dspark_num_experts_per_tok"):
        _llm(llama_dir, _spec(dspark_n_routed_experts=4))


# ------------------------------------------------------------------------------------------ V4 and V4.1


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """(transformers model, folder) of the tiny V4 (v4-yarn: 4 layers, 2 streams, YoCo off)."""
    folder = tmp_path_factory.mktemp("v4")
    return build_v4("v4-yarn", folder), folder


@pytest.fixture(scope="module")
def v41(tmp_path_factory) -> Path:
    """A tiny V4.1 with Engram on layers 0 and 1, shifted hyper-connections and cross-layer sharing."""
    folder = tmp_path_factory.mktemp("v41")
    build_v41(folder, **ENGRAM)
    return folder


def _v4_llm(folder: Path, plugins: dict | None = None, **kw: object) -> LLM:
    return make_llm(folder, plugins=plugins or {}, max_model_len=256, **kw)


def test_v4_features_are_the_mean_of_transformers_streams_entering_each_target_layer(v4):
    main, folder = v4
    layers = [0, 2, 4]
    llm = _v4_llm(folder, cache={"prefix_caching": False}, max_num_batched_tokens=256)
    model = llm.engine.model
    seq = _prompts(1, 5)[0] + _prompts(1, 6)[0]
    model.capture_hidden(layers)
    llm.generate([seq], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ours = {i: model.captured_hidden[i] for i in layers}
    kept: dict[int, torch.Tensor] = {}
    hooks = [main.model.layers[i].register_forward_pre_hook(
        lambda module, args, kwargs, i=i: kept.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0]),
        with_kwargs=True) for i in layers if i < 4]
    hooks.append(main.model.layers[-1].register_forward_hook(
        lambda module, args, out: kept.__setitem__(4, (out[0] if isinstance(out, tuple) else out)[0])))
    with torch.no_grad():
        main(torch.tensor([seq]))
    for hook in hooks:
        hook.remove()
    for i in layers:
        theirs = kept[i]
        assert theirs.shape == (len(seq), 2, 64), i  # [n, m, H]: the streams
        torch.testing.assert_close(ours[i], theirs.mean(1), rtol=0, atol=1e-4 * float(theirs.abs().max()))


def test_v41_features_are_the_streams_after_engram(v41):
    llm = _v4_llm(v41, cache={"prefix_caching": False}, max_num_batched_tokens=256)
    model = llm.engine.model
    seq = _prompts(1, 12)[0]
    kept: dict[int, torch.Tensor] = {}
    hooks = [model.layers[0].engram.register_forward_hook(lambda m, a, out: kept.__setitem__(0, out)),
             model.layers[3].register_forward_pre_hook(lambda m, args: kept.__setitem__(3, args[0]))]
    model.capture_hidden([0, 3])
    llm.generate([seq], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for hook in hooks:
        hook.remove()
    for i in (0, 3):
        torch.testing.assert_close(model.captured_hidden[i], kept[i].mean(1))
    assert not torch.equal(model.captured_hidden[0], model.embed_tokens(torch.tensor(seq)))  # Engram changed it


def _check_context_every_step(llm: LLM, scratch: LLM, prompts: list[list[int]], params: SamplingParams,
                              reference: list[list[int]], window: int) -> int:
    """Run ``prompts`` on ``llm`` (dspark), checking at every draft that each request's context window equals
    ``context_kv`` of its committed tokens' features recomputed by a prefill on ``scratch`` (no prefix cache);
    accepted drafts are planted (the reference continuation for a random number of leading drafts, then a
    wrong token). Returns the number of windows checked."""
    drafter: DSparkDrafter = _dspark(llm)
    layers = llm.engine.model.captured_layers
    full = {tuple(p): p + r for p, r in zip(prompts, reference, strict=True)}
    propose, gen, checked = drafter.propose, torch.Generator().manual_seed(9), [0]

    def features_of(tokens: list[int]) -> torch.Tensor:
        model = scratch.engine.model
        model.capture_hidden(layers)
        scratch.generate([tokens], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        return torch.cat([model.captured_hidden[i] for i in layers], dim=-1)

    def checking(inputs):
        proposal = propose(inputs)
        if inputs.last_tokens.shape[0] == 0:
            return proposal
        checked[0] += inputs.last_tokens.shape[0]
        return check_window_and_plant(drafter, inputs, proposal, features_of, full, window, gen, VOCAB)

    drafter.propose = checking
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    return checked[0]


def _assert_all_returned(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    kv = llm.engine.kv
    assert not kv.slots and len(kv.free_slots) == llm.engine.num_state_slots - 1


@pytest.mark.parametrize("target", ["v4", "v41"])
def test_dspark_on_deepseek_v4_context_cache_and_greedy_identity(target, request):
    folder = request.getfixturevalue("v4")[1] if target == "v4" else request.getfixturevalue("v41")
    window = 6
    prompts = [*_prompts(2, 7), torch.randint(2, VOCAB, (41,), generator=torch.Generator().manual_seed(8)).tolist()]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in _v4_llm(folder).generate(prompts, params, use_tqdm=False)]
    spec = _spec(dspark_context_window=window, dspark_target_layer_ids=[1, 3, 4] if target == "v4" else [0, 2, 5],
                 **MOE)
    llm = _v4_llm(folder, spec, max_num_batched_tokens=24)
    scratch = _v4_llm(folder, cache={"prefix_caching": False}, max_num_batched_tokens=256)
    checked = _check_context_every_step(llm, scratch, prompts, params, reference, window)
    assert checked > 10 and llm.get_stats()["spec_decode"]["mean_acceptance_length"] > 1.5
    _assert_all_returned(llm)
    for plan in ("fixed", "varlen"):  # unplanted drafts (random weights), both plans
        plain = _v4_llm(folder, _spec(plan, **MOE), max_num_batched_tokens=24)
        assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == reference, plan
        assert plain.get_stats()["spec_decode"]["verify_steps"] > 0
        _assert_all_returned(plain)


def test_the_trainer_trains_moe_blocks():
    """``DrafterTrainer`` (what ``train_drafter`` runs) on a MoE-block drafter: the loss falls and the replay
    finds a planted rule (every token the previous + 1), as for dense blocks (``test_drafter_training.py``).
    ``train_drafter`` builds MoE blocks when its ``Recipe.drafter`` carries the MoE fields, which ``auto`` and
    ``deepinfer train-drafter`` put there when they are set (``drafter_cache.auto_recipe``); a dense shape's
    recipe is the one it had before MoE blocks existed."""
    from deepinfer_spec_decode.drafter_training import Recipe
    from test_drafter_training import train_on_counting

    vocab, hidden, k = 64, 16, 4
    torch.manual_seed(0)
    net = DSparkNetwork(hidden, 1, vocab, num_layers=1, heads=2, intermediate=16, markov_rank=8, dtype=torch.float32,
                        device=torch.device("cpu"), experts=4, experts_per_token=2)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert Recipe(drafter=MOE).spec_config().dspark_n_routed_experts == 4
    experts_before = net.layers[0].moe.experts_gate_up.detach().clone()
    losses, before, after = train_on_counting(net, vocab, hidden, k)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert before["mean_acceptance_length"] < 1.5 < 3.0 < after["mean_acceptance_length"] <= k + 1
    assert not torch.equal(experts_before, net.layers[0].moe.experts_gate_up)  # the routed experts learned too


def test_v41_features_under_yoco_truncation(v41):
    """Compact YoCo truncation (floor 61 of a 70-token prompt, chunks [0, 40) and [40, 70)): a producer
    layer's features (layer 0) are every row's, as in mask mode; a consumer layer's (layer 3) and the final
    streams' equal mask mode's on the kept rows and are zeros below the floor. With dspark on, compact and
    mask generate the same greedy tokens as no speculation, and every block comes back."""
    from test_deepseek_v41 import _truncated_prefill

    llm = _v4_llm(v41)
    model = llm.engine.model
    model.capture_hidden([0, 3, 5])
    _truncated_prefill(llm, "mask", [1, 2, 3, 4, 5], 1)
    mask = {i: model.captured_hidden[i].clone() for i in (0, 3, 5)}
    _truncated_prefill(llm, "compact", [6, 7, 8, 9, 10], 2)
    compact = {i: model.captured_hidden[i].clone() for i in (0, 3, 5)}
    kept = slice(61 - 40, 30)
    torch.testing.assert_close(compact[0], mask[0], atol=1e-5, rtol=0)
    for i in (3, 5):
        assert compact[i].shape == mask[i].shape == (30, 64)
        torch.testing.assert_close(compact[i][kept], mask[i][kept], atol=1e-5, rtol=0)
        assert compact[i][:kept.start].abs().max() == 0 and mask[i][:kept.start].abs().max() > 0
    batch = [*_prompts(2, 21), torch.randint(2, VOCAB, (70,), generator=torch.Generator().manual_seed(5)).tolist()]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in _v4_llm(v41).generate(batch, params, use_tqdm=False)]
    for mode in ("mask", "compact"):
        plugins = {**_spec(dspark_target_layer_ids=[0, 3, 5], **MOE),
                   "attention": {"enabled": True, "replay": {"mode": mode, "keep_tokens": 16}}}
        spec = _v4_llm(v41, plugins, max_num_batched_tokens=32)
        assert [o.outputs[0].token_ids for o in spec.generate(batch, params, use_tqdm=False)] == reference, mode
        assert spec.get_stats()["spec_decode"]["verify_steps"] > 0
        _assert_all_returned(spec)


def test_auto_and_train_drafter_record_moe_fields_only_when_set():
    """``auto_recipe`` (what ``dspark_weights: auto`` and ``deepinfer train-drafter`` train) carries the MoE
    fields of a MoE shape, so its drafter is trained with MoE blocks; a dense shape's recipe, and so the
    cache key of drafters trained before MoE blocks existed, is unchanged."""
    from deepinfer_spec_decode.drafter_cache import ARCHITECTURE_FIELDS, auto_recipe

    dense = auto_recipe(SpecDecodeConfig(drafter="dspark"))
    assert set(dense.drafter) == set(ARCHITECTURE_FIELDS)
    moe = auto_recipe(SpecDecodeConfig(drafter="dspark", **MOE))
    assert moe.drafter["dspark_n_routed_experts"] == MOE["dspark_n_routed_experts"]
    assert moe.spec_config().dspark_num_experts_per_tok == MOE["dspark_num_experts_per_tok"]
    assert moe.key() != dense.key()
