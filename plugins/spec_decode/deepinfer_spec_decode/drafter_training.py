"""``deepinfer train-drafter``: self-distillation of the ``dspark`` drafter on the target's own replies.

1. **Prompts** from text already on the machine (``drafter_data``): chat instructions of six kinds for
   chat models, continuation prompts for base models; a held-out set from disjoint passages/templates.
2. **Replies the target generates itself**, batched through the engine (``LLM.generate``): a share
   greedy, the rest sampled (temperature ``sample_temperature``) for diversity; held-out replies greedy.
3. **Labels by teacher forcing** (``LLM.teacher_force``): over prompt + reply, the target's ``top_k``
   next-token logits at every position and the inputs of the drafter's target layers (its features).
4. **Training** (AdamW, seeded). An example is an anchor ``a`` in a reply: the drafter sees the features
   of rows ``a − W … a − 1`` (its context window, ``dspark_context_window``) and the block ``[s_a, noise,
   …]`` exactly as at inference (``dspark.py``); a batch is runs of consecutive anchors, whose windows
   overlap, so each context row is projected once per batch; block row
   ``i`` is scored against the target's distribution at position ``a + i`` (its top-k, renormalized over
   the draft vocabulary) by cross-entropy, weighted ``position_decay ** i``; the Markov correction sees
   the true previous token ``s_{a+i}`` (what it sees at inference whenever the drafts before were
   accepted). The confidence head learns, by binary cross-entropy, whether the drafter's own greedy
   choice at ``i`` equals the target's greedy token there — the probability that draft ``i`` is
   accepted given the drafts before it were, which is what ``varlen`` ranks by.
5. **Held-out acceptance**: greedy speculative decoding with the ``fixed`` plan is replayed offline on the
   held-out replies (start after the prompt; each step verifies up to ``max_draft`` drafts, accepts the
   leading ones equal to the target's greedy tokens plus the bonus token, and moves on), giving the
   mean acceptance length and acceptance by position as the engine's statistics count them, and the
   raw confidence head's calibration error (ECE, 10 bins, over the positions whose prefix was accepted)
   — stored in the manifest beside the weights.

The draft vocabulary (``draft_vocab_size``) is the most frequent tokens of the training replies; a
smaller one makes the drafter's LM head (the target's rows for those tokens) cheaper per draft.
Everything is seeded; the generated replies (chunk by chunk), the labelled data and training
checkpoints live in a work folder, so a run that is stopped resumes where it was (same recipe, same
folder).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from deepinfer.errors import ConfigError
from deepinfer.ops import cache_dir as cache_root
from deepinfer.ops import init_dummy
from deepinfer_spec_decode.config import SpecDecodeConfig
from deepinfer_spec_decode.drafter_data import Prompt, chat_prompts, continuation_prompts, local_passages
from deepinfer_spec_decode.dspark import DSparkNetwork, build_network, lm_head_of, save_weights, target_layers

logger = logging.getLogger(__name__)

RECIPE_VERSION = 4  # bump when the training procedure changes what a recipe produces


@dataclass(frozen=True)
class Recipe:
    """What a trained drafter depends on besides the target (its hash keys the cache, ``weights_cache``).

    ``prompts``/``held_out``: training and held-out prompt counts; ``max_reply_tokens`` per reply;
    ``greedy_fraction`` of training replies greedy, the others at ``sample_temperature``; ``top_k``
    target logits kept per position; ``draft_vocab_size`` (None: the target's whole vocabulary);
    ``steps`` optimizer steps of ``batch`` anchors at learning rate ``lr`` (cosine decay after
    ``warmup`` steps); ``position_decay`` the weight of block row i is decay^i; ``confidence_weight`` of
    the confidence loss; ``seed``; ``chat`` (None: chat prompts when the tokenizer has a chat template).
    ``drafter``: the drafter's architecture fields of ``plugins.spec_decode`` (``dspark_*``, ``max_draft``).
    """

    prompts: int = 320
    held_out: int = 48
    max_reply_tokens: int = 128
    greedy_fraction: float = 0.5
    sample_temperature: float = 0.7
    top_k: int = 32
    draft_vocab_size: int | None = 8192
    steps: int = 3000
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 100
    position_decay: float = 0.8
    confidence_weight: float = 0.5
    seed: int = 0
    chat: bool | None = None
    drafter: dict[str, Any] = dataclasses.field(default_factory=dict)

    def key(self) -> str:
        """A short hash of the recipe (and the procedure's version)."""
        text = json.dumps({"version": RECIPE_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def spec_config(self) -> SpecDecodeConfig:
        """The ``plugins.spec_decode`` section the drafter is built from."""
        return SpecDecodeConfig(drafter="dspark", **self.drafter)


@dataclass
class Sequences:
    """Prompt + reply token ids with the prompt lengths and each sequence's kind."""

    token_ids: list[list[int]]
    prompt_lens: list[int]
    kinds: list[str]


def target_hash(model_path: Path) -> str:
    """A hash of the target: its ``config.json`` and every weight file (sizes and sha256 of their bytes)."""
    digest = hashlib.sha256()
    files = sorted([model_path / "config.json", *model_path.glob("*.safetensors")])
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def _encode_prompts(llm: Any, prompts: Sequence[Prompt], chat: bool) -> list[list[int]]:
    tokenizer = llm.tokenizer
    if chat:
        return [tokenizer.encode_chat([{"role": "user", "content": p.text}])[1] for p in prompts]
    return [tokenizer.encode_prompt(p.text) for p in prompts]


def generate_replies(llm: Any, prompts: Sequence[Prompt], recipe: Recipe, *, greedy_only: bool, seed: int,
                     checkpoint: Path | None = None, chunk: int = 64) -> Sequences:
    """The target's own replies to ``prompts``, batched through the engine ``chunk`` prompts at a time;
    with a ``checkpoint`` file every finished chunk is kept there, with the prompts' token ids and kinds,
    and a rerun continues after it (each request's sampling settings depend only on its index, so the
    result does not depend on where a run stopped). A checkpoint is self-contained: its prompts win over
    ``prompts`` (the passages on another machine differ), so replies generated elsewhere — on a GPU —
    can be copied into a work folder and labelled and trained on here."""
    from deepinfer import SamplingParams

    chat = recipe.chat if recipe.chat is not None else _has_chat_template(llm)
    ids = _encode_prompts(llm, prompts, chat)
    kinds = [p.kind for p in prompts]
    replies: list[list[int]] = []
    if checkpoint is not None and checkpoint.exists():
        saved = json.loads(checkpoint.read_text())
        if not isinstance(saved, dict) or len(saved.get("prompts", ())) != len(prompts):
            raise ConfigError(f"{checkpoint}: not a replies checkpoint for {len(prompts)} prompts (delete it to "
                              "generate the replies again)")
        ids, kinds, replies = saved["prompts"], saved["kinds"], saved["replies"]
        logger.info("resumed %d of %d replies from %s", len(replies), len(prompts), checkpoint)
    rng = random.Random(seed)
    params = []
    for i in range(len(prompts)):
        greedy = greedy_only or rng.random() < recipe.greedy_fraction
        params.append(SamplingParams(temperature=0.0 if greedy else recipe.sample_temperature,
                                     max_tokens=recipe.max_reply_tokens, seed=seed * 100_003 + i))
    with tqdm(total=len(prompts), initial=len(replies), desc="replies", unit="req") as bar:
        while len(replies) < len(prompts):
            lo = len(replies)
            hi = min(len(prompts), lo + chunk)
            outs = llm.generate(ids[lo:hi], params[lo:hi], use_tqdm=False)
            replies.extend(list(o.outputs[0].token_ids) for o in outs)
            bar.update(hi - lo)
            if checkpoint is not None:
                _save(checkpoint, lambda f: f.write_text(json.dumps({"prompts": ids, "kinds": kinds,
                                                                     "replies": replies})))
    return Sequences([p + r for p, r in zip(ids, replies, strict=True)], [len(p) for p in ids], kinds)


def _has_chat_template(llm: Any) -> bool:
    tokenizer = llm.tokenizer
    try:
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
    except Exception:  # a base model's tokenizer has no template (the renderer says so in its own words)
        return False
    return True


@dataclass
class Labels:
    """Teacher-forced labels of a set of sequences, concatenated: row r belongs to ``seq_of[r]`` at
    position ``pos_of[r]``; ``features [R, H·L]``, ``top_ids``/``top_logits [R, K]``, ``tokens [R]`` the
    token at each row (so ``tokens[r + 1]`` follows ``tokens[r]`` inside a sequence)."""

    features: torch.Tensor
    top_ids: torch.Tensor
    top_logits: torch.Tensor
    tokens: torch.Tensor
    starts: list[int]  # first row of each sequence
    prompt_lens: list[int]
    lengths: list[int]

    def to(self, device: torch.device | str) -> Labels:
        """The same labels with their tensors on ``device`` (training reads them there: no per-step copy)."""
        return dataclasses.replace(self, features=self.features.to(device), top_ids=self.top_ids.to(device),
                                   top_logits=self.top_logits.to(device), tokens=self.tokens.to(device))

    @functools.cached_property
    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's first row and length as host tensors (the batches' index arithmetic)."""
        return torch.tensor(self.starts), torch.tensor(self.lengths)

    def anchors(self, k: int) -> torch.Tensor:
        """Rows ``a`` (global) that can anchor a block: inside a reply, with a row before them."""
        rows = [s + p for s, p, n in zip(self.starts, self.prompt_lens, self.lengths, strict=True)
                for p in range(max(1, p), n)]
        return torch.tensor(rows, dtype=torch.int64)


def teacher_labels(llm: Any, seqs: Sequences, layers: Sequence[int], top_k: int) -> Labels:
    """``LLM.teacher_force`` over ``seqs`` (features of ``layers``, top-``top_k`` logits)."""
    forced = llm.teacher_force(seqs.token_ids, top_k=top_k, layers=layers, use_tqdm=True)
    starts, total = [], 0
    for seq in seqs.token_ids:
        starts.append(total)
        total += len(seq)
    return Labels(torch.cat([f.features for f in forced]), torch.cat([f.top_ids for f in forced]),
                  torch.cat([f.top_logits for f in forced]),
                  torch.tensor([t for s in seqs.token_ids for t in s], dtype=torch.int64),
                  starts, list(seqs.prompt_lens), [len(s) for s in seqs.token_ids])


def draft_vocabulary(seqs: Sequences, size: int, vocab: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of the replies (ties by id), as target ids ``[size]``."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for ids, p in zip(seqs.token_ids, seqs.prompt_lens, strict=True):
        counts += torch.bincount(torch.tensor(ids[p:], dtype=torch.int64), minlength=vocab)
    order = torch.argsort(-counts * vocab + torch.arange(vocab), stable=True)  # count desc, then id asc
    return order[:min(size, vocab)].sort().values


def anchor_runs(count: int, batch: int, gen: torch.Generator, run: int = 8) -> torch.Tensor:
    """``batch`` indices into ``count`` anchors, drawn as runs of ``run`` consecutive ones: neighbouring
    anchors share most of their context window, which a training batch then projects once."""
    run = max(1, min(run, batch, count))
    starts = torch.randint(0, count - run + 1, (-(-batch // run),), generator=gen)
    return (starts.unsqueeze(1) + torch.arange(run)).flatten()[:batch]


class DrafterTrainer:
    """The drafter's training step and offline evaluation against teacher-forced labels."""

    def __init__(self, network: DSparkNetwork, embed: torch.nn.Embedding, lm_head: torch.Tensor,
                 noise_token_id: int, k: int, recipe: Recipe) -> None:
        self.network = network
        self.embed = embed
        self.head = network.head_of(lm_head)
        self.noise_token_id = noise_token_id
        self.k = k
        self.recipe = recipe
        self.window = recipe.spec_config().dspark_context_window
        self.device = embed.weight.device
        self.decay = torch.tensor([recipe.position_decay ** i for i in range(k)], device=self.device)
        params = [p for p in network.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
        self.step_count = 0

    def _batch(self, labels: Labels, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inputs and targets of blocks anchored at ``anchors`` (global rows). The index arithmetic runs
        on the host; the gathers run where the labels live (``Labels.to``)."""
        k, window = self.k, self.window
        starts, lengths = labels.bounds
        rows = anchors.unsqueeze(1) + torch.arange(k)  # [B, k] rows a … a + k − 1
        seq = torch.bucketize(anchors, starts, right=True) - 1
        ends = starts[seq] + lengths[seq]  # one past each sequence
        valid = rows < ends.unsqueeze(1)
        rows = torch.where(valid, rows, anchors.unsqueeze(1))
        where = labels.tokens.device
        rows_at = rows.to(where, non_blocking=True)
        block = torch.full((anchors.shape[0], k), self.noise_token_id, dtype=torch.int64, device=where)
        block[:, 0] = labels.tokens[anchors.to(where, non_blocking=True)]
        # The context window: rows a − W … a − 1 of the anchor's sequence; each distinct row is projected once.
        context_rows = anchors.unsqueeze(1) - window + torch.arange(window)
        visible = context_rows >= starts[seq].unsqueeze(1)
        context_rows = torch.maximum(context_rows, starts[seq].unsqueeze(1))
        unique, index = torch.unique(context_rows, return_inverse=True)
        unique_pos = unique - starts[torch.bucketize(unique, starts, right=True) - 1]
        block_positions = (anchors - starts[seq]).unsqueeze(1) + torch.arange(k)
        batch = {"context_features": labels.features[unique.to(where, non_blocking=True)],
                 "context_positions": unique_pos, "context_index": index,
                 "visible": visible, "block": block, "block_positions": block_positions,
                 "previous": labels.tokens[rows_at], "top_ids": labels.top_ids[rows_at],
                 "top_logits": labels.top_logits[rows_at], "valid": valid}
        return {name: t.to(self.device, non_blocking=True) for name, t in batch.items()}

    def _forward(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Corrected logits ``[B, k, Vd]`` and confidence logits ``[B, k]`` (teacher-forced previous tokens)."""
        net = self.network
        with torch.no_grad():
            embedded = self.embed(b["block"])
        # index_select rather than indexing: its gradient is one index_add_, where indexing's is a sorting
        # index_put_ (~12% of a CPU training step)
        rows = net.context_kv(b["context_features"], b["context_positions"])
        index = b["context_index"]
        context = rows.index_select(0, index.flatten()).view(*index.shape, *rows.shape[1:])
        before_norm, normed = net.block(context, b["visible"], embedded, b["block_positions"])
        markov = net.markov_head.embed(net.to_draft_ids(b["previous"]))
        logits = F.linear(normed, self.head).float() + net.markov_head.head(markov).float()
        z = net.confidence_head.proj(torch.cat([before_norm, markov], dim=-1)).float().squeeze(-1)
        return logits, z

    def _soft_targets(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k distribution over draft ids ``[B, k, K]`` (renormalized over the ids inside the
        draft vocabulary) and those draft ids (clamped; weight 0 outside)."""
        net = self.network
        draft_ids = net.to_draft_ids(b["top_ids"])
        inside = draft_ids < net.draft_vocab_size
        probs = torch.softmax(b["top_logits"], dim=-1) * inside
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
        return probs, draft_ids.clamp(max=net.draft_vocab_size - 1)

    def train_step(self, labels: Labels, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
        """One optimizer step on the blocks anchored at ``anchors``; its losses and the share of accepted
        positions as device scalars (reading them is the caller's choice: each read waits for the step)."""
        self.network.train()
        b = self._batch(labels, anchors)
        logits, z = self._forward(b)
        probs, ids = self._soft_targets(b)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids)
        weight = b["valid"].float() * self.decay
        ce = -(probs * logp).sum(-1)
        draft_loss = (ce * weight).sum() / weight.sum()
        with torch.no_grad():
            chosen = self.network.to_target_ids(logits.argmax(-1))
            accepted = (chosen == b["top_ids"][..., 0]).float()
        bce = F.binary_cross_entropy_with_logits(z, accepted, reduction="none")
        conf_loss = (bce * b["valid"]).sum() / b["valid"].sum()
        loss = draft_loss + self.recipe.confidence_weight * conf_loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.network.parameters(), 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()
        self.optimizer.step()
        self.step_count += 1
        return {"loss": loss.detach(), "draft": draft_loss.detach(), "confidence": conf_loss.detach(),
                "accept": (accepted * b["valid"]).sum() / b["valid"].sum()}

    def _lr(self) -> float:
        r, s = self.recipe, self.step_count
        if s < r.warmup:
            return r.lr * (s + 1) / r.warmup
        progress = min(1.0, (s - r.warmup) / max(1, r.steps - r.warmup))
        return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    @torch.no_grad()
    def evaluate(self, labels: Labels, bins: int = 10) -> dict[str, Any]:
        """Greedy speculative decoding replayed on ``labels`` (module docstring, step 5)."""
        self.network.eval()
        k = self.k
        accepted_lengths: list[int] = []
        verified = torch.zeros(k)
        accepted_at = torch.zeros(k)
        confidences: list[float] = []
        outcomes: list[float] = []
        anchors = []
        for start, p, n in zip(labels.starts, labels.prompt_lens, labels.lengths, strict=True):
            anchors.extend(start + a for a in range(max(1, p), n))
        if not anchors:
            return {"mean_acceptance_length": 0.0, "steps": 0}
        # Draft every anchor once (teacher-forced previous tokens equal the drafts while they are accepted).
        matches, conf = [], []
        for chunk in torch.tensor(anchors).split(256):
            b = self._batch(labels, chunk)
            logits, z = self._forward(b)
            chosen = self.network.to_target_ids(logits.argmax(-1))
            matches.append((chosen == b["top_ids"][..., 0]) & b["valid"])
            conf.append(torch.sigmoid(z))
        match_of = dict(zip(anchors, torch.cat(matches).tolist(), strict=True))
        conf_of = dict(zip(anchors, torch.cat(conf).tolist(), strict=True))
        for start, p, n in zip(labels.starts, labels.prompt_lens, labels.lengths, strict=True):
            a = start + max(1, p)
            end = start + n
            while a < end - 1:  # a step needs at least one token after the anchor to verify
                room = min(k, end - 1 - a)
                hits = match_of[a][:room]
                m = next((i for i, h in enumerate(hits) if not h), room)
                accepted_lengths.append(m + 1)
                for i in range(room):  # as the engine counts: every verified position, accepted if i < m
                    verified[i] += 1
                    accepted_at[i] += float(i < m)
                for i in range(min(m + 1, room)):  # calibration: the positions whose prefix was accepted
                    confidences.append(conf_of[a][i])
                    outcomes.append(float(hits[i]))
                a += m + 1
        c, o = torch.tensor(confidences), torch.tensor(outcomes)
        edges = torch.clamp((c * bins).long(), max=bins - 1)
        ece = sum(float((edges == j).sum()) / max(1, len(c)) * abs(float(c[edges == j].mean() - o[edges == j].mean()))
                  for j in range(bins) if bool((edges == j).any()))
        return {"mean_acceptance_length": sum(accepted_lengths) / len(accepted_lengths),
                "acceptance_by_position": (accepted_at / verified.clamp_min(1)).tolist(),
                "ece": ece, "steps": len(accepted_lengths)}


def _save(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` to a file beside ``path``, then renamed over it: a run killed mid-write (a time limit)
    leaves the previous checkpoint whole, never a truncated one that a resumed run would fail to load."""
    part = path.with_name(path.name + ".part")
    write(part)
    os.replace(part, path)


def _state_path(work: Path) -> Path:
    return work / "checkpoint.pt"


def train_drafter(model: str, *, output: str | Path | None = None, recipe: Recipe | None = None,
                  minutes: float | None = None, device: str | None = None,
                  engine_overrides: dict[str, Any] | None = None, work_dir: str | Path | None = None,
                  log: Callable[[str], None] = logger.info) -> Path:
    """Train a ``dspark`` drafter for ``model`` and write its weights (``output``, default the cache path of
    ``weights_cache``) with a manifest ``<output>.json`` beside them. ``minutes`` caps the optimizer's wall
    time (data generation not included); ``engine_overrides`` are ``LLM`` keyword overrides for the
    target (e.g. ``plugins``). Returns the weights' path."""
    from deepinfer import LLM

    recipe = recipe or Recipe()
    torch.manual_seed(recipe.seed)
    overrides = dict(engine_overrides or {})
    if device is not None:
        overrides["device"] = device
    llm = LLM(model, **overrides)
    engine = llm.engine
    if llm.tokenizer is None:
        raise ConfigError(f"training a drafter for {str(engine.model_path)!r} needs its tokenizer (the prompts are "
                          "text); the folder has none: give plugins.spec_decode.dspark_weights a file or 'random'")
    path = Path(output) if output is not None else weights_cache(engine.model_path, recipe)
    work = Path(work_dir) if work_dir is not None else path.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    cfg = recipe.spec_config()
    target = engine.model
    layers = target_layers(cfg, len(target.layers))
    k = cfg.max_draft

    data_file = work / "data.pt"
    started = time.perf_counter()
    if data_file.exists():
        data = torch.load(data_file, weights_only=False)
        log(f"resumed the generated data from {data_file}")
    else:
        data = _make_data(llm, recipe, layers, work)
        _save(data_file, functools.partial(torch.save, data))
    gen_seconds = time.perf_counter() - started
    train_labels, held_labels, train_seqs = data["train"], data["held_out"], data["train_seqs"]
    if engine.device.type == "cuda":  # batches gathered on the device: no host copy of features per step
        train_labels, held_labels = train_labels.to(engine.device), held_labels.to(engine.device)

    vocab = target.vocab_size
    draft_size = recipe.draft_vocab_size if recipe.draft_vocab_size and recipe.draft_vocab_size < vocab else None
    network = build_network(target, cfg, len(layers), draft_vocab_size=draft_size).float()
    if draft_size is not None:
        network.set_draft_vocab(draft_vocabulary(train_seqs, draft_size, vocab).to(network.d2t.device))
    init_dummy(network, recipe.seed)
    noise = cfg.dspark_noise_token_id if cfg.dspark_noise_token_id is not None else vocab - 1
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.detach().float(), freeze=True)
    trainer = DrafterTrainer(network, embed, lm_head_of(target).float(), noise, k, recipe)
    state_file = _state_path(work)
    if state_file.exists():
        state = torch.load(state_file, weights_only=False)
        network.load_state_dict(state["network"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.step_count = state["step"]
        log(f"resumed training at step {trainer.step_count}")
    anchors = train_labels.anchors(k)
    gen = torch.Generator().manual_seed(recipe.seed + trainer.step_count)
    budget = None if minutes is None else minutes * 60.0
    t0 = time.perf_counter()
    bar = tqdm(total=recipe.steps, initial=trainer.step_count, desc="train-drafter", unit="step")
    last: dict[str, float] = {}
    # On a CPU, denormal floats are flushed to zero while training: after ~100 steps the drafter's small
    # gradients and Adam moments are denormals often enough that a step of 64 anchors took 360 ms instead of
    # 175 (measured on a 2-core Xeon). The flag is the thread's; it is cleared again after the loop.
    flush = engine.device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        while trainer.step_count < recipe.steps:
            if budget is not None and time.perf_counter() - t0 > budget:
                log(f"stopped at step {trainer.step_count}: the {minutes} min budget is spent")
                break
            pick = anchors[anchor_runs(anchors.shape[0], recipe.batch, gen)]
            stats = trainer.train_step(train_labels, pick)
            bar.update(1)
            if trainer.step_count % 50 == 0 or trainer.step_count == recipe.steps:
                last = {n: float(v) for n, v in stats.items()}
                bar.set_postfix({n: f"{v:.3f}" for n, v in last.items()})
            if trainer.step_count % 250 == 0:
                _save(state_file, functools.partial(torch.save, {
                    "network": network.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                    "step": trainer.step_count}))
    finally:
        if flush:
            torch.set_flush_denormal(False)
    bar.close()
    train_seconds = time.perf_counter() - t0
    held = trainer.evaluate(held_labels)
    log(f"held-out: mean acceptance length {held['mean_acceptance_length']:.3f}, ECE {held.get('ece', 0):.4f}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_weights(network.to(target.embed_tokens.weight.dtype), path)
    reply_tokens = sum(n - p for n, p in zip(train_labels.lengths, train_labels.prompt_lens, strict=True))
    coverage = None
    if draft_size is not None:
        inside = torch.isin(held_labels.tokens.cpu(), network.d2t.cpu())
        coverage = float(inside.float().mean())
    manifest = {
        "target": str(engine.model_path), "target_hash": target_hash(engine.model_path),
        "recipe": dataclasses.asdict(recipe), "recipe_key": recipe.key(), "drafter": "dspark",
        "target_layers": list(layers), "draft_vocab_size": draft_size or vocab,
        "data": {"train_sequences": len(train_labels.lengths), "train_reply_tokens": reply_tokens,
                 "held_out_sequences": len(held_labels.lengths), "anchors": int(anchors.shape[0]),
                 "kinds": sorted(set(data["kinds"])), "sources": "CPython stdlib docstrings/code, installed "
                 "packages' METADATA; replies generated by the target", "draft_vocab_coverage": coverage},
        "steps": trainer.step_count, "seed": recipe.seed, "last_step": last,
        "generation_seconds": round(gen_seconds, 1), "train_seconds": round(train_seconds, 1),
        "held_out": held, "torch": torch.__version__,
    }
    manifest_path(path).write_text(json.dumps(manifest, indent=2))
    log(f"wrote {path} and {manifest_path(path)}")
    llm.shutdown()
    return path


def _make_data(llm: Any, recipe: Recipe, layers: Sequence[int], work: Path) -> dict[str, Any]:
    rng = random.Random(recipe.seed)
    train_pool, held_pool = local_passages().split(0.15, rng)
    chat = recipe.chat if recipe.chat is not None else _has_chat_template(llm)
    if chat:
        train_prompts = chat_prompts(recipe.prompts, train_pool, rng, held_out=False)
        held_prompts = chat_prompts(recipe.held_out, held_pool, rng, held_out=True)
    else:
        train_prompts = continuation_prompts(recipe.prompts, train_pool, rng)
        held_prompts = continuation_prompts(recipe.held_out, held_pool, rng)
    # A checkpoint every chunk of replies: 64 on CPU (minutes each), a whole engine batch on a GPU.
    max_seqs = llm.engine.config.scheduler.max_num_seqs
    chunk = max_seqs if llm.engine.device.type == "cuda" else min(64, max_seqs)
    train_seqs = generate_replies(llm, train_prompts, recipe, greedy_only=False, seed=recipe.seed,
                                  checkpoint=work / "replies-train.json", chunk=chunk)
    held_seqs = generate_replies(llm, held_prompts, recipe, greedy_only=True, seed=recipe.seed + 1,
                                 checkpoint=work / "replies-held-out.json", chunk=chunk)
    return {"train": teacher_labels(llm, train_seqs, layers, recipe.top_k),
            "held_out": teacher_labels(llm, held_seqs, layers, recipe.top_k),
            "train_seqs": train_seqs, "held_seqs": held_seqs,
            "kinds": train_seqs.kinds + held_seqs.kinds}


def manifest_path(weights: Path) -> Path:
    """The manifest beside a weights file."""
    return weights.with_suffix(".json")


def cache_dir() -> Path:
    """``drafters`` under the project's cache root (``deepinfer.ops.cache_dir``: ``$DEEPINFER_CACHE_DIR``,
    else ``~/.cache/deepinfer``)."""
    return cache_root() / "drafters"


def weights_cache(model_path: Path, recipe: Recipe) -> Path:
    """Where ``dspark_weights: auto`` keeps the drafter of this target and recipe."""
    return cache_dir() / f"dspark-{target_hash(model_path)}-{recipe.key()}.safetensors"
