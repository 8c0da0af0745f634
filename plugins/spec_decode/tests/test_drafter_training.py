"""Drafter training (``drafter_training``): the training step lowers the loss and learns a planted rule the
offline acceptance replay then finds; ``dspark_weights: auto`` trains once on first use and loads after;
a reduced draft vocabulary maps drafts and distributions back to target ids; the CLI finds the trainer."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from deepinfer_spec_decode import drafter_cache
from deepinfer_spec_decode.drafter_data import HELD_OUT_TEMPLATES, KINDS, TEMPLATES, Passages, Prompt, chat_prompts
from deepinfer_spec_decode.drafter_training import (
    DrafterTrainer,
    Labels,
    Recipe,
    generate_replies,
    manifest_path,
)
from deepinfer_spec_decode.dspark import DSparkNetwork, draft_block
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.cli import main
from deepinfer.errors import ConfigError
from deepinfer.plugins import discover_plugins, drafter_trainers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _network(vocab: int, hidden: int = 16, draft_vocab_size: int | None = None) -> DSparkNetwork:
    torch.manual_seed(0)
    net = DSparkNetwork(hidden, 1, vocab, num_layers=1, heads=2, intermediate=32, markov_rank=8,
                        dtype=torch.float32, device=torch.device("cpu"), draft_vocab_size=draft_vocab_size)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return net


def _counting_labels(vocab: int, hidden: int, sequences: int, length: int, seed: int) -> Labels:
    """Sequences where every token is the previous one + 1 (mod vocab); the target knows it exactly."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [(int(torch.randint(0, vocab, (), generator=gen)) + torch.arange(length)) % vocab
              for _ in range(sequences)]
    flat = torch.cat(tokens)
    following = (flat + 1) % vocab
    top_ids = torch.stack([following, (following + 7) % vocab], dim=-1)
    top_logits = torch.tensor([[8.0, 0.0]]).expand(flat.shape[0], 2).clone()
    return Labels(torch.randn(flat.shape[0], hidden, generator=gen), top_ids, top_logits, flat,
                  [i * length for i in range(sequences)], [2] * sequences, [length] * sequences)


def train_on_counting(net: DSparkNetwork, vocab: int, hidden: int, k: int) -> tuple[list[float], dict, dict]:
    """150 steps of ``DrafterTrainer`` on the planted counting rule: (losses, held-out evaluation before, after)."""
    embed = torch.nn.Embedding(vocab, hidden)
    torch.nn.init.normal_(embed.weight, generator=torch.Generator().manual_seed(3))
    recipe = Recipe(steps=150, batch=32, lr=1e-2, warmup=10)
    trainer = DrafterTrainer(net, embed, embed.weight.detach(), vocab - 1, k, recipe)
    train, held = _counting_labels(vocab, hidden, 32, 24, 1), _counting_labels(vocab, hidden, 8, 24, 2)
    before = trainer.evaluate(held)
    anchors = train.anchors(k)
    gen = torch.Generator().manual_seed(0)
    losses = [float(trainer.train_step(train, anchors[torch.randint(0, len(anchors), (32,), generator=gen)])["loss"])
              for _ in range(recipe.steps)]
    return losses, before, trainer.evaluate(held)


def test_training_lowers_the_loss_and_the_replay_finds_the_planted_rule():
    vocab, hidden, k = 64, 16, 4
    losses, before, after = train_on_counting(_network(vocab, hidden), vocab, hidden, k)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert before["mean_acceptance_length"] < 1.5 < 3.0 < after["mean_acceptance_length"] <= k + 1
    assert 0.0 <= after["ece"] <= 1.0 and len(after["acceptance_by_position"]) == k


def test_a_reduced_draft_vocabulary_proposes_target_ids_and_reports_their_distribution():
    net = _network(10, hidden=4, draft_vocab_size=3)
    net.set_draft_vocab(torch.tensor([2, 5, 9]))
    assert net.to_draft_ids(torch.tensor([5, 0, 9])).tolist() == [1, 3, 2]  # 0 is outside: the extra row
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]]])  # favours draft ids 1 then 0
    with torch.no_grad():
        net.markov_head.head.weight.zero_()
    tokens, probs, _ = draft_block(logits, torch.zeros(1, 2, 4), torch.tensor([0]), net, torch.ones(2),
                                   torch.tensor([0.7]), torch.tensor([3]), torch.tensor([4]), report_probs=True)
    assert probs is not None and probs.shape == (1, 2, 10)
    assert probs[0, :, [0, 1, 3, 4, 6, 7, 8]].abs().max() == 0  # nothing outside the draft vocabulary
    torch.testing.assert_close(probs[0].sum(-1), torch.ones(2))
    assert set(tokens[0].tolist()) <= {2, 5, 9}
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    torch.testing.assert_close(probs[0][:, [2, 5, 9]], expected)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and vocabulary (chat template included)."""
    folder = tmp_path_factory.mktemp("tinychat")
    save_tiny("llama", folder, vocab_size=49152)
    for f in smollm2_dir.glob("tokenizer*"):
        shutil.copy(f, folder)
    return folder


TINY_RECIPE = {"prompts": 8, "held_out": 4, "max_reply_tokens": 12, "steps": 12, "batch": 8,
               "draft_vocab_size": 256}


def test_auto_trains_on_first_use_then_loads_and_stays_lossless(tiny_chat_model, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    spec = {"spec_decode": {"enabled": True, "drafter": "dspark", "plan": "fixed", "max_draft": 3,
                            "dspark_num_heads": 2, "dspark_auto_recipe": TINY_RECIPE}}
    kw = {"block_size": 16, "kv_cache_bytes": 1 << 23}
    first = LLM(tiny_chat_model, plugins=spec, **kw)
    files = sorted((tmp_path / "cache" / "drafters").glob("dspark-*.safetensors"))
    assert len(files) == 1
    manifest = json.loads(manifest_path(files[0]).read_text())
    assert manifest["steps"] == TINY_RECIPE["steps"] and manifest["draft_vocab_size"] == 256
    assert manifest["data"]["train_sequences"] == 8 and manifest["held_out"]["steps"] > 0
    assert first.engine.speculator.drafter.inner.network.draft_vocab_size == 256

    def refuse(*args, **kwargs):
        raise AssertionError("a cached drafter must not be trained again")

    monkeypatch.setattr(drafter_cache, "train_drafter", refuse)
    second = LLM(tiny_chat_model, plugins=spec, **kw)
    for a, b in zip(first.engine.speculator.drafter.inner.network.state_dict().values(),
                    second.engine.speculator.drafter.inner.network.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    prompts = [[1, 2, 3, 4], list(range(10, 40))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(tiny_chat_model, **kw).generate(prompts, params, use_tqdm=False)
    spec_out = second.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in spec_out]


def test_a_replies_checkpoint_is_self_contained_and_resumes(tiny_chat_model, tmp_path):
    """A checkpoint keeps the prompts' ids: one written elsewhere (other passages, e.g. on a GPU machine) is
    used as it is, a run stopped after one chunk continues it, and a file of another shape is refused."""
    llm = LLM(tiny_chat_model, block_size=16, kv_cache_bytes=1 << 23)
    recipe = Recipe(max_reply_tokens=6)
    here = [Prompt("question", f"What is {i} plus {i}?") for i in range(4)]
    elsewhere = [Prompt("code", f"Write a function number {i}.") for i in range(4)]
    whole = generate_replies(llm, elsewhere, recipe, greedy_only=True, seed=0)
    checkpoint = tmp_path / "replies.json"
    first = generate_replies(llm, elsewhere[:2], recipe, greedy_only=True, seed=0, checkpoint=checkpoint, chunk=2)
    saved = json.loads(checkpoint.read_text())
    saved["prompts"] += [[1]] * 2  # a run of 4 prompts stopped after its first chunk of 2
    saved["kinds"] += ["code"] * 2
    checkpoint.write_text(json.dumps(saved))
    resumed = generate_replies(llm, here, recipe, greedy_only=True, seed=0, checkpoint=checkpoint, chunk=2)
    assert resumed.token_ids[:2] == first.token_ids == whole.token_ids[:2]
    assert resumed.kinds == ["code"] * 4 and resumed.prompt_lens[2:] == [1, 1]
    checkpoint.write_text(json.dumps([[5, 6]]))
    with pytest.raises(ConfigError, match="not a replies checkpoint"):
        generate_replies(llm, here, recipe, greedy_only=True, seed=0, checkpoint=checkpoint)


def test_the_cli_finds_the_trainer_and_refuses_unknown_drafters(capsys):
    assert "dspark" in drafter_trainers(discover_plugins())
    assert main(["train-drafter", "--drafter", "nope"]) == 2
    assert "trainers: dspark" in capsys.readouterr().err
    assert main(["train-drafter", "--recipe", "steps"]) == 2


def test_held_out_prompts_share_no_template_or_passage_with_training_prompts():
    """Every kind is built, and held-out prompts use templates and passages the training prompts never see."""
    pool = Passages(code=[f"def f{i:02d}(x):\n    return x" for i in range(20)],
                    text=[f"Passage {i:02d} about something." for i in range(20)],
                    topics=[f"topic {i:02d}" for i in range(20)], subjects=[f"subject {i:02d}" for i in range(20)])
    train_pool, held_pool = pool.split(0.25, random.Random(0))
    train = chat_prompts(120, train_pool, random.Random(1), held_out=False)
    held = chat_prompts(120, held_pool, random.Random(2), held_out=True)
    assert {p.kind for p in train} == {p.kind for p in held} == set(KINDS)

    def filled(prompt):
        """The template index and the passage that make ``prompt``."""
        for index, template in enumerate(TEMPLATES[prompt.kind]):
            pattern = re.escape(template).replace(r"\{", "{").replace(r"\}", "}")
            match = re.fullmatch(re.sub(r"{\w+}", "(.+)", pattern), prompt.text, flags=re.DOTALL)
            if match:
                return index, match.group(1)
        raise AssertionError(f"no template of {prompt.kind!r} makes {prompt.text!r}")

    for prompts, pools, held_out in ((train, train_pool, False), (held, held_pool, True)):
        for prompt in prompts:
            index, passage = filled(prompt)
            assert (index >= len(TEMPLATES[prompt.kind]) - HELD_OUT_TEMPLATES) == held_out
            assert passage in pools.code + pools.text + pools.topics + pools.subjects
