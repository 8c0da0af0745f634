"""``dspark``: the DSpark/DFlash block drafter (reference/deepinfer.md §4) for any model that can
``capture_hidden`` (the Llama family, Gemma 3, DeepSeek-V3, DeepSeek-V4 and V4.1).

**Features.** The drafter has the main model capture the residual stream entering each layer of
``dspark_target_layer_ids`` (``dspark_target_attn_input``: the attention input's residual, the reference's
only choice); on DeepSeek-V4/V4.1, whose layers pass ``hc_mult`` hyper-connection streams, that is the
mean of the streams entering the layer (V4.1: after its Engram memory), as the reference's
``dflash_input_store``. The runner keeps those features of every committed row, concatenated
(``CommittedRows.hidden``, ``[R, H · L]``).

**Context cache** (the reference's ``update_main_cache``). Right after every step, on the device, each
row's features become one context row ``c = main_norm(main_proj(features))``, and each drafter layer projects
it to its own key and value (``ctx_kv``; the key RoPE'd at the row's position). They are written to a
cache ``[slots, layers, 2, H]`` indexed by the main pool's slot of the row's position
(``CommittedRows.ctx.slot_mapping``): the cache follows the main KV cache's blocks — freed with them,
shared through the prefix cache (a hit's positions were written by the request that computed them) and
overwritten when a block is reused. Every row of the step is written (``CommittedRows``); a rejected
draft's row lies past its request's committed length, which no window reads, and is written again when
that position is computed for real, so nothing is rolled back. While no request drafts (every one's
drafting paused by the plan) nothing reads the cache: the steps' rows wait (``DSparkDrafter.pending``, at most
``PENDING_ROWS``) and are written in one pass before the next draft, the newest row of a slot winning, as
step-by-step writes would leave it.

**One pass for the block.** The block is the golden token followed by ``k − 1`` copies of
``dspark_noise_token_id``, embedded with the main model's embedding, at positions ``n − 1 … n + k − 2``
(the golden token's own position first). In each of the drafter's blocks (pre-norm attention, then a
SwiGLU MLP, or a MoE: below) every block row attends, without a causal mask, to the keys and values of the request's
last ``W = dspark_context_window`` committed rows (positions ``n − 1 − W … n − 2``, read from the
cache through the request's block table; fewer at the start of a sequence) and to all ``k`` block rows,
with RoPE at their absolute positions; then ``norm`` and the main model's shared LM head give float32
logits for all ``k`` rows at once. Row ``i`` predicts draft ``i + 1``.

**MoE blocks** (``dspark_n_routed_experts`` E > 0, ``dspark_num_experts_per_tok`` k_e; the reference's
fields, routed as its DeepSeek MoE): a block's MLP output is its dense SwiGLU MLP (the shared expert) plus
the routed experts' weighted sum; a row's scores are ``sqrt(softplus(x · routerᵀ))`` (float32), its
experts the top k_e of ``score + router_bias`` (a selection-only bias), their weights the chosen scores
over their sum; every expert is a SwiGLU MLP of width ``I``.

**Markov correction and confidence** (sequential over the k positions, ``draft_block``): the logits
of row ``i`` get ``markov_head.head(markov_head.embed(previous))`` added, where ``previous`` is the
golden token for ``i = 0`` and draft ``i − 1`` after; the draft is chosen from the corrected logits as
``mtp`` chooses (argmax for greedy requests, the request's temperature and counter RNG otherwise, with
the distribution reported so verification stays lossless). The raw confidence of draft ``i`` is
``sigmoid(clamp(confidence_head.proj([h_i, e_i]) / T_i, ±60))``, with ``h_i`` the block row before the
final norm, ``e_i`` the Markov embedding of its previous token and ``T_i`` the position's
``dspark_confidence_temperature``; the plugin calibrates it and the ``varlen`` plan ranks by it.

**Draft vocabulary.** A trained drafter may propose from a subset of the target's vocabulary
(``d2t``, draft id → target id, as EAGLE-3's map): its output head is then the target's LM head rows
of those tokens (``Vd`` rows instead of ``V``: for SmolLM2 8,192 of 49,152, for Gemma-3 far fewer of
262k), its Markov head scores ``Vd`` tokens, and a previous token outside the subset embeds through
one extra row. Drafts are mapped back to target ids and their distributions reported over the whole
vocabulary (zero outside the subset), so verification stays lossless: a token outside is simply never
proposed.

**Fused passes.** When the engine's GEMM backend offers ``draft_context`` / ``draft_block`` (``plugins/cpu``'s,
in C), the drafter hands it the dense network as an ``interfaces.BlockDrafterStack`` and the context write and
greedy drafting run there; what it does not serve (sampling drafts, MoE blocks, more rows than it takes) runs the
modules above.

**Weights** (``dspark_weights``: ``auto``, a file or ``random``; one safetensors file, names without a
prefix; ``H`` the main model's hidden size, ``L`` the number of target layers, ``I`` the intermediate
size, ``r`` the Markov rank, ``V`` the vocabulary or ``Vd`` the draft vocabulary):
``main_proj.weight [H, H·L]``, ``main_norm.weight [H]``, per block ``b``: ``layers.{b}.attn_norm.weight
[H]``, ``layers.{b}.qkv.weight [3H, H]`` (q, k, v stacked), ``layers.{b}.ctx_kv.weight [2H, H]`` (the
context rows' k, v stacked; optional: without it the context rows go through the layer's ``attn_norm``
and the k, v rows of ``qkv``, the layout of drafters trained before the context window, which behave as
they did with ``dspark_context_window: 1``), ``layers.{b}.o.weight [H, H]``,
``layers.{b}.mlp_norm.weight [H]``, ``layers.{b}.gate_up.weight [2I, H]`` (gate, up stacked),
``layers.{b}.down.weight [H, I]``, and in MoE blocks ``layers.{b}.moe.router.weight [E, H]``,
``layers.{b}.moe.router_bias [E]``, ``layers.{b}.moe.experts_gate_up [E, 2I, H]`` (gate, up stacked),
``layers.{b}.moe.experts_down [E, H, I]``; ``norm.weight [H]``, ``markov_head.embed.weight [V, r]`` (``[Vd + 1,
r]`` with a draft vocabulary), ``markov_head.head.weight [V or Vd, r]``, ``confidence_head.proj.weight
[1, H + r]``, ``confidence_head.proj.bias [1]``, and with a draft vocabulary ``d2t [Vd]`` (int64, distinct
target ids). ``auto`` reads the drafter ``deepinfer train-drafter`` trained for this target and recipe
(``drafter_training``, ``drafter_cache``; trained on first use); ``random`` fills random weights from
the engine seed (acceptance then is near zero; for tests and mechanism benchmarks). ``save_weights``
writes this layout.

Where this differs from the reference (reference/deepinfer.md §4): the drafter layers are pre-norm blocks
with multi-head attention and a dense or MoE MLP (the reference's are full V4 decoder blocks:
hyper-connections, MLA with one 512-d latent KV head, grouped low-rank output and sinks over an SWA ring);
its MoE has one shared expert of the routed experts' width, no ``routed_scaling_factor`` (1), no SwiGLU
clamp and no ``moe_intermediate_size`` of its own (``dspark_intermediate_size`` for every expert), and
computes each routed expert with plain GEMMs (not the engine's ``experts`` op); so a V4.1 checkpoint's
DSpark heads (``mtp.{i}.*``) do not load: of them only ``main_proj``, ``main_norm``, the final ``norm``,
``markov_head.*`` and ``confidence_head.proj.weight`` (no bias there) have this layout's shapes, the blocks'
attention and hyper-connection tensors have no counterpart here; ``auto`` and ``deepinfer train-drafter``
build dense blocks only (their recipe's architecture fields lack the MoE ones; ``DrafterTrainer`` itself
trains MoE blocks); ``dspark_target_attn_input`` must be true (as the reference asserts); each layer
projects the context with its own ``ctx_kv`` (the reference: one fused ``main_kv_proj`` for all layers, a
kv-norm and an MXFP8 ring); the context cache lives beside the KV pool (sized to its slots from the model's
bound cache, outside the KV budget) instead of in per-request SWA rings; block keys are not written to the
cache (they live one pass); the attention key range is not padded to 64; drafting replays CUDA graphs
(``draft_graphs``: the context write per bucket of the step's rows, the block pass per bucket of the drafting
batch; ``kernels.cuda_graphs`` on a CUDA device) with dense blocks only (MoE blocks read their experts on the
host and run eagerly), and after a greedy step that replayed a target graph the core captures the drafting with
the verification in one graph of its own (``engine/tail_graphs.py``; ``graph_capturable``, ``settle``), its own
graphs then stepping aside; V4.1's ``dspark_target_layer_ids`` / ``dspark_noise_token_id`` /
``dspark_markov_rank`` in its ``config.json`` are not read (the plugin's fields apply); under YoCo compact
prefill truncation (V4/V4.1) the rows below a request's truncation floor have zero features in target layers
past the YoCo boundary (the reference writes only the kept rows too, but its drafter window is the model's
sliding window, which never reaches below the floor; ``dspark_context_window`` is free), so a longer window
reaching there reads zero-feature rows (lower acceptance, still lossless); drafts for sampling requests use
the temperature only (no top-k/top-p).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.interfaces import (
    BlockDrafterLayer,
    BlockDrafterStack,
    CommittedRows,
    DraftInputs,
    DraftProposal,
    EngineInfo,
    GemmBackend,
)
from deepinfer.ops import RMSNorm, init_dummy, row_argmax
from deepinfer_spec_decode.config import SpecDecodeConfig
from deepinfer_spec_decode.draft_graphs import Outputs, PaddedGraphs
from deepinfer_spec_decode.mtp import choose_drafts

EPS = 1e-6
ROPE_THETA = 10000.0
LOGIT_CLAMP = 60.0  # the confidence head's sigmoid argument is clamped at ±60 (reference §4)
WRITE_GRAPH_ROWS = 1024  # the largest step (rows) whose context write replays a CUDA graph
DRAFT_GRAPH_BATCH = 256  # the largest drafting batch whose block pass replays a CUDA graph
PENDING_ROWS = 4096  # context rows kept unwritten at most while no request drafts (DSparkDrafter.propose)
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # y = x · Wᵀ (F.linear, or a GEMM backend's)


def default_target_layers(num_layers: int) -> list[int]:
    """Layer 1, the middle layer and the last layer (their inputs), for a model of ``num_layers``."""
    return sorted({min(1, num_layers), max(0, 1 + (num_layers - 2) // 2), max(0, num_layers - 1)})


Rotary = tuple[torch.Tensor, torch.Tensor]  # the cos and sin tables of some offsets (``rotary``)


def inverse_frequencies(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """The rope's angle per offset of each rotated pair of a head of ``head_dim`` (float32 ``[head_dim / 2]``)."""
    half = head_dim // 2
    return ROPE_THETA ** (-torch.arange(half, dtype=torch.float32, device=device) / half)


def rotary(offsets: torch.Tensor, head_dim: int, dtype: torch.dtype) -> Rotary:
    """The rotary tables of ``offsets`` for heads of ``head_dim`` in ``dtype``: ``cos``, ``sin`` of shape
    ``[*offsets.shape, head_dim / 2]``. Computed once per block pass or context write and shared by every
    layer (and by a layer's queries and keys): a drafting step on the CPU pays per torch op."""
    angles = offsets.to(torch.float32).unsqueeze(-1) * inverse_frequencies(head_dim, offsets.device)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(x: torch.Tensor, tables: Rotary) -> torch.Tensor:
    """Rotary embedding (halves layout) of ``x [..., S, head_dim]`` with the ``tables`` (``rotary``) of its
    offsets (broadcast to ``[..., S]``: ``[S]``, or ``[B, 1, S]`` for ``x [B, heads, S, head_dim]``)."""
    cos, sin = tables
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DSparkBlock(nn.Module):
    """Pre-norm attention of the block rows over ``[context window, block]`` (no causal mask), then a
    SwiGLU MLP. The context's keys and values are the layer's own projection (``ctx_kv``) of the
    projected target features, RoPE'd at their positions (``context_kv``)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, *, separate_context: bool = True,
                 experts: int = 0, experts_per_token: int = 0, **kw: Any) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(hidden, EPS, **kw)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **kw)
        self.ctx_kv = nn.Linear(hidden, 2 * hidden, bias=False, **kw) if separate_context else None
        self.o = nn.Linear(hidden, hidden, bias=False, **kw)
        self.mlp_norm = RMSNorm(hidden, EPS, **kw)
        # The dense SwiGLU MLP; in a MoE block it is the shared expert (the reference's one shared MLP).
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False, **kw)
        self.down = nn.Linear(intermediate, hidden, bias=False, **kw)
        self.moe = DSparkMoE(hidden, intermediate, experts, experts_per_token, **kw) if experts else None

    def heads_of(self, t: torch.Tensor) -> torch.Tensor:
        """``[..., S, H]`` → ``[..., heads, S, head_dim]``."""
        return t.unflatten(-1, (self.heads, -1)).transpose(-3, -2)

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor, linear: Linear = F.linear,
                   tables: Rotary | None = None) -> torch.Tensor:
        """``context [N, H]`` projected target rows at ``positions [N]`` → their keys (RoPE'd) and values
        ``[N, 2, H]`` (through ``ctx_kv``, or without it the block rows' ``attn_norm`` and ``qkv``).
        ``tables``: ``rotary(positions, …)`` when the caller has them."""
        if self.ctx_kv is None:
            key, value = linear(self.attn_norm(context), self.qkv.weight).chunk(3, dim=-1)[1:]
        else:
            key, value = linear(context, self.ctx_kv.weight).chunk(2, dim=-1)
        key = self.heads_of(key.unsqueeze(0))
        if tables is None:
            tables = rotary(positions, key.shape[-1], key.dtype)
        key = rope(key, tables)[0].transpose(0, 1).flatten(-2)
        return torch.stack([key, value], dim=1)

    def forward(self, x: torch.Tensor, context: torch.Tensor, visible: torch.Tensor,
                positions: torch.Tensor, linear: Linear = F.linear, tables: Rotary | None = None) -> torch.Tensor:
        """``x [B, k, H]`` block rows at ``positions [B, k]``, ``context [B, W, 2, H]`` the window's keys and
        values, ``visible [B, W]`` which window rows exist → ``[B, k, H]``. ``tables``: ``rotary`` of
        ``positions.unsqueeze(1)`` when the caller has them."""
        batch, k, hidden = x.shape
        q, key, value = (self.heads_of(t) for t in linear(self.attn_norm(x), self.qkv.weight).chunk(3, dim=-1))
        if tables is None:
            tables = rotary(positions.unsqueeze(1), q.shape[-1], q.dtype)
        q, key = rope(q, tables), rope(key, tables)
        context_key, context_value = context.unbind(2)  # views; in training one stack as their gradient
        key = torch.cat([self.heads_of(context_key), key], dim=2)
        value = torch.cat([self.heads_of(context_value), value], dim=2)
        mask = torch.cat([visible, visible.new_ones(batch, k)], dim=1)[:, None, None, :]
        attn = F.scaled_dot_product_attention(q, key, value, attn_mask=mask)
        x = x + linear(attn.transpose(1, 2).reshape(batch, k, hidden), self.o.weight)
        normed = self.mlp_norm(x)
        gate, up = linear(normed, self.gate_up.weight).chunk(2, dim=-1)
        out = linear(F.silu(gate) * up, self.down.weight)
        if self.moe is not None:
            out = out + self.moe(normed)
        return x + out


class DSparkMoE(nn.Module):
    """The routed experts of a MoE block, routed as the reference's DeepSeek MoE (reference/deepinfer.md
    §4, §11; ``deepseek_v4/moe.py``): scores ``sqrt(softplus(x · routerᵀ))`` in float32, the top
    ``experts_per_token`` of ``score + router_bias`` (the selection-only correction bias), weights the
    chosen scores over their sum (+1e-20); each expert a SwiGLU MLP of width ``intermediate``. The
    block adds the shared expert (its dense MLP) to this output."""

    def __init__(self, hidden: int, intermediate: int, experts: int, experts_per_token: int, **kw: Any) -> None:
        super().__init__()
        self.top_k = experts_per_token
        self.router = nn.Linear(hidden, experts, bias=False, **kw)
        self.router_bias = nn.Parameter(torch.zeros(experts, **kw), requires_grad=False)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden, **kw))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, intermediate, **kw))
        nn.init.normal_(self.experts_gate_up, std=hidden ** -0.5)
        nn.init.normal_(self.experts_down, std=intermediate ** -0.5)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, H]`` → each row's experts ``[N, top_k]`` int64 and their weights ``[N, top_k]`` float32."""
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.router.weight.float())))
        ids = (scores + self.router_bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` (the block's MLP input, after ``mlp_norm``) → the weighted routed experts' sum."""
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.route(flat)
        out = torch.zeros_like(flat)
        # One GEMM pair per expert over its rows; the expert list is read on the host (a deliberate sync: the
        # drafter runs eagerly, and a block has few rows).
        for expert in ids.unique().tolist():
            rows, choice = (ids == expert).nonzero(as_tuple=True)
            gate, up = F.linear(flat[rows], self.experts_gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts_down[expert])
            out = out.index_add(0, rows, y * weights[rows, choice].unsqueeze(-1).to(y.dtype))
        return out.view_as(x)


class MarkovHead(nn.Module):
    """First-order Markov correction: ``head(embed(previous token))`` added to a draft's logits."""

    def __init__(self, vocab: int, rank: int, *, extra_rows: int = 0, **kw: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab + extra_rows, rank, **kw)  # extra row: tokens outside a draft vocabulary
        self.head = nn.Linear(rank, vocab, bias=False, **kw)


class ConfidenceHead(nn.Module):
    """``proj([hidden before the final norm, Markov embedding]) → 1`` logit per draft."""

    def __init__(self, width: int, **kw: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1, **kw)


class DSparkNetwork(nn.Module):
    """The drafter's weights (layout in the module docstring) and its one-pass block forward."""

    def __init__(self, hidden: int, num_targets: int, vocab: int, *, num_layers: int, heads: int,
                 intermediate: int, markov_rank: int, dtype: torch.dtype, device: torch.device,
                 draft_vocab_size: int | None = None, separate_context: bool = True, experts: int = 0,
                 experts_per_token: int = 0) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.vocab = vocab
        self.head_dim = hidden // heads
        self.main_proj = nn.Linear(hidden * num_targets, hidden, bias=False, **kw)
        self.main_norm = RMSNorm(hidden, EPS, **kw)
        self.layers = nn.ModuleList(DSparkBlock(hidden, heads, intermediate, separate_context=separate_context,
                                                experts=experts, experts_per_token=experts_per_token, **kw)
                                    for _ in range(num_layers))
        self.norm = RMSNorm(hidden, EPS, **kw)
        reduced = draft_vocab_size is not None
        self.markov_head = MarkovHead(draft_vocab_size or vocab, markov_rank, extra_rows=int(reduced), **kw)
        self.confidence_head = ConfidenceHead(hidden + markov_rank, **kw)
        # Draft id → target id (a buffer saved with the weights, filled by ``load_weights`` or
        # ``set_draft_vocab``), or None for the whole vocabulary.
        d2t = torch.arange(draft_vocab_size, dtype=torch.int64, device=device) if reduced else None
        self.register_buffer("d2t", d2t)
        self.t2d: torch.Tensor | None = None  # target id → draft id (draft_vocab_size where outside), derived

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the drafter can propose (the target's vocabulary unless reduced)."""
        return self.vocab if self.d2t is None else self.d2t.shape[0]

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """Use the target ids ``d2t [Vd]`` (distinct, in the target's vocabulary) as the draft vocabulary."""
        assert self.d2t is not None and d2t.shape == self.d2t.shape, "the network was sized for another vocabulary"
        self.d2t.copy_(d2t)
        self._derive_t2d()

    def _derive_t2d(self) -> None:
        if self.d2t is None:
            return
        t2d = torch.full((self.vocab,), self.d2t.shape[0], dtype=torch.int64, device=self.d2t.device)
        t2d[self.d2t] = torch.arange(self.d2t.shape[0], device=self.d2t.device)
        self.t2d = t2d

    def head_of(self, lm_head: torch.Tensor) -> nn.Parameter:
        """The drafter's output head: the target's LM head ``[V, H]`` (shared, never trained), or its rows of
        the draft vocabulary. A frozen parameter, so a GEMM backend may pack it once."""
        self._derive_t2d()
        head = lm_head.detach() if self.d2t is None else lm_head.detach().index_select(0, self.d2t)
        return nn.Parameter(head, requires_grad=False)

    def to_draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids → draft ids (``draft_vocab_size``, the Markov head's extra row, where outside)."""
        return tokens if self.t2d is None else self.t2d[tokens]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids → target ids."""
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
        """Target features ``[N, H·L]`` of committed rows at ``positions [N]`` → every layer's keys and
        values of them ``[N, layers, 2, H]`` (what the drafter's context cache keeps per row). ``linear``
        computes every projection (the engine's GEMM backend when drafting; ``F.linear`` in training)."""
        context = self.main_norm(linear(features, self.main_proj.weight))
        tables = rotary(positions, self.head_dim, context.dtype)
        return torch.stack([layer.context_kv(context, positions, linear, tables) for layer in self.layers], dim=1)

    def block(self, context: torch.Tensor, visible: torch.Tensor, embedded: torch.Tensor,
              positions: torch.Tensor, linear: Linear = F.linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``embedded [B, k, H]`` block at ``positions [B, k]`` over each request's context window
        (``context [B, W, layers, 2, H]`` from ``context_kv``, ``visible [B, W]``) → (block rows before the
        final norm, after it), both ``[B, k, H]``."""
        x = embedded
        tables = rotary(positions.unsqueeze(1), self.head_dim, x.dtype)
        for layer, layer_context in zip(self.layers, context.unbind(2), strict=True):
            x = layer(x, layer_context, visible, positions, linear, tables)
        return x, self.norm(x)


def draft_block(logits: torch.Tensor, hidden: torch.Tensor, last_tokens: torch.Tensor, network: DSparkNetwork,
                confidence_temperature: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor, report_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Drafts from a block's ``logits [B, k, Vd]`` (float32, over the draft vocabulary) with the first-order
    Markov correction, in order.

    ``hidden [B, k, H]`` the block rows before the final norm, ``last_tokens [B]`` the golden tokens,
    ``confidence_temperature [k]`` the sigmoid temperatures, ``temperature``/``seeds [B]`` the
    requests' sampling settings and ``positions [B]`` their last tokens' positions (draft ``i`` lands
    at ``position + 1 + i``). Returns ``tokens [B, k]`` int64 target ids, the distributions they were
    drawn from over the target's vocabulary ``[B, k, V]`` (zero outside the draft vocabulary; None unless
    ``report_probs``) and the raw confidences ``[B, k]`` float32 in (0, 1)."""
    batch, k, _ = logits.shape
    markov, confidence_head = network.markov_head, network.confidence_head
    probs = (torch.zeros(batch, k, network.vocab, dtype=torch.float32, device=logits.device)
             if report_probs else None)
    previous = network.to_draft_ids(last_tokens)
    embeddings, drafts = [], []
    for i in range(k):  # in order: each position's Markov correction reads the draft before it
        embedding = markov.embed(previous)
        corrected = logits[:, i] + markov.head(embedding).float()
        if report_probs:
            draft, dist, _ = choose_drafts(corrected, temperature, seeds, positions + 1 + i)
            if network.d2t is None:
                probs[:, i] = dist
            else:
                probs[:, i].index_copy_(-1, network.d2t, dist)
        else:  # every request greedy (``DraftInputs.sampling`` false): the argmax, nothing drawn
            draft = row_argmax(corrected)
        embeddings.append(embedding)
        drafts.append(draft)
        previous = draft
    # The confidences of every position at once (one projection, as training computes them).
    z = confidence_head.proj(torch.cat([hidden, torch.stack(embeddings, dim=1)], dim=-1)).float().squeeze(-1)
    confidence = torch.sigmoid((z / confidence_temperature[:k]).clamp(-LOGIT_CLAMP, LOGIT_CLAMP))
    return network.to_target_ids(torch.stack(drafts, dim=1)), probs, confidence


class DSparkDrafter:
    """The block drafter over the model's captured features (see the module docstring)."""

    def __init__(self, model: Any, network: DSparkNetwork, noise_token_id: int,
                 confidence_temperature: Sequence[float], window: int, cuda_graphs: bool = False) -> None:
        self.model = model
        self.network = network
        self.noise_token_id = noise_token_id
        self.window = window
        self.dtype = network.main_proj.weight.dtype  # the drafter's (``drafter_dtype``); the target's may differ
        self.head = network.head_of(lm_head_of(model).to(self.dtype))
        device = model.embed_tokens.weight.device
        self.confidence_temperature = torch.tensor(confidence_temperature, dtype=torch.float32, device=device)
        # The context cache: every layer's keys and values of each committed row, in the main pool's slot of
        # the row's position (so it follows the main cache's blocks: freed, shared and reused with them).
        hidden = model.embed_tokens.weight.shape[1]
        self.context = torch.zeros(pool_slots(model), len(network.layers), 2, hidden, dtype=self.dtype, device=device)
        # CUDA graphs of the context write and of the block drafting (draft_graphs.py), built on the first
        # step whose GEMM backend is graph-safe; MoE blocks read their experts on the host, so they stay eager.
        self.cuda_graphs = cuda_graphs and device.type == "cuda" and not any(layer.moe for layer in network.layers)
        # The core may capture ``propose`` in its speculative-tail graphs (``interfaces.GraphDrafter``).
        self.graph_capturable = self.cuda_graphs
        self.linear: Linear | None = None
        # A GEMM backend that runs the drafter's passes itself (GemmBackend.draft_context / draft_block), and the
        # network as it reads it; None when it does not or the network has MoE blocks or no ctx_kv.
        self.fused: GemmBackend | None = None
        self.stack: BlockDrafterStack | None = None
        # Context rows not written yet (``propose``): (features, slots, positions) per step, and their rows.
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.pending_rows = 0
        self.write_graphs: PaddedGraphs | None = None
        self.draft_graphs: PaddedGraphs | None = None

    def window_slots(self, rows: CommittedRows, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each drafting request's context window: the cache slots of positions ``p − W + 1 … p`` (``p`` its
        last committed row's position, ``positions − 1``) ``[B, W]`` and which of them exist ``visible [B, W]``."""
        ctx = rows.ctx
        window = positions.unsqueeze(1) - self.window + 1 + torch.arange(self.window, device=positions.device)
        visible = window >= 0
        window = window.clamp_min(0)
        request = torch.bucketize(rows.last_rows, ctx.query_start_loc[1:], right=True)
        tables = ctx.block_tables.index_select(0, request)
        slots = tables.gather(1, window // ctx.block_size) * ctx.block_size + window % ctx.block_size
        return slots, visible

    def write_context(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> Outputs:
        """Every committed row's context keys and values into the cache (``features [N, H·L]`` at ``slots`` and
        ``positions [N]``)."""
        assert self.linear is not None
        features = features.to(self.dtype)
        if self.stack is not None and self.fused.draft_context(self.stack, features, positions, slots, self.context):
            return ()
        self.context[slots] = self.network.context_kv(features, positions, self.linear)
        return ()

    def draft(self, slots: torch.Tensor, visible: torch.Tensor, last_tokens: torch.Tensor, positions: torch.Tensor,
              temperature: torch.Tensor, seeds: torch.Tensor, k: int, report_probs: bool) -> Outputs:
        """The block pass and the drafts of ``B`` requests over their windows (``window_slots``): tokens
        ``[B, k]``, their distributions ``[B, k, V]`` (None unless ``report_probs``) and raw confidences."""
        assert self.linear is not None
        batch, dev = last_tokens.shape[0], last_tokens.device
        block_ids = torch.full((batch, k), self.noise_token_id, dtype=torch.int64, device=dev)
        block_ids[:, 0] = last_tokens
        embedded = self.model.embed_tokens(block_ids).to(self.dtype)
        if self.stack is not None and not report_probs:
            fused = self.fused.draft_block(self.stack, self.context, slots, visible, embedded, last_tokens, positions)
            if fused is not None:
                return fused[0], None, fused[1]
        block_positions = positions.unsqueeze(1) + torch.arange(k, device=dev)
        before_norm, normed = self.network.block(self.context[slots], visible, embedded, block_positions, self.linear)
        logits = self.linear(normed.reshape(batch * k, -1), self.head)
        return draft_block(logits.float().reshape(batch, k, -1), before_norm, last_tokens, self.network,
                           self.confidence_temperature, temperature, seeds, positions, report_probs)

    def _write_pending(self) -> None:
        """Write the context rows of the steps since the last write, oldest first, in one pass (a later step's
        row of a slot overwrites an earlier one's, as written step by step). Padding rows write the reserved
        scratch slot 0."""
        steps = len(self.pending)
        features, slots, positions = (torch.cat(parts) if steps > 1 else parts[0]
                                      for parts in zip(*self.pending, strict=True))
        self.pending, self.pending_rows = [], 0
        if steps > 1:  # a slot written by several steps (a rejected draft's row, a reused block) takes the newest
            order = torch.arange(slots.shape[0], device=slots.device)  # row; the older ones go to the scratch slot
            newest = torch.full((self.context.shape[0],), -1, dtype=torch.int64, device=slots.device)
            newest.scatter_reduce_(0, slots, order, reduce="amax")
            slots = torch.where(newest[slots] == order, slots, 0)
        written = [(features, 0), (slots, 0), (positions, 0)]
        graphs = self._own_graphs(self.write_graphs)
        if graphs is None or graphs(features.shape[0], written) is None:
            self.write_context(features, slots, positions)

    def _stack(self) -> BlockDrafterStack | None:
        """The network as a GEMM backend's fused passes read it (``interfaces.BlockDrafterStack``), or None when
        it has MoE blocks or layers without ``ctx_kv`` (the layout before the context window)."""
        net = self.network
        if any(layer.moe is not None or layer.ctx_kv is None for layer in net.layers):
            return None
        layers = tuple(BlockDrafterLayer(layer.attn_norm.weight, layer.qkv.weight, layer.ctx_kv.weight, layer.o.weight,
                                         layer.mlp_norm.weight, layer.gate_up.weight, layer.down.weight)
                       for layer in net.layers)
        proj, markov = net.confidence_head.proj, net.markov_head
        return BlockDrafterStack(
            main_proj=net.main_proj.weight, main_norm=net.main_norm.weight, layers=layers, norm=net.norm.weight,
            head=self.head, markov_embed=markov.embed.weight, markov_head=markov.head.weight,
            confidence_weight=proj.weight, confidence_bias=proj.bias,
            confidence_temperature=self.confidence_temperature,
            inv_freq=inverse_frequencies(net.head_dim, self.context.device), d2t=net.d2t, t2d=net.t2d,
            heads=net.layers[0].heads, eps=EPS)

    @staticmethod
    def _own_graphs(graphs: PaddedGraphs | None) -> PaddedGraphs | None:
        """The drafter's own graphs, unless the core is capturing it in a graph of its own (the speculative tail)."""
        return None if graphs is None or torch.cuda.is_current_stream_capturing() else graphs

    @torch.inference_mode()
    def settle(self) -> None:
        """Write the context rows still waiting (``interfaces.GraphDrafter``: before a replayed tail)."""
        if self.pending:
            self._write_pending()

    def _bind(self, rows: CommittedRows) -> None:
        """The engine's GEMMs (on CPU: packed once, not per call), and the graphs when they may capture them."""
        backend = rows.ctx.backends["linear"]
        self.linear = backend.linear
        if callable(getattr(backend, "draft_block", None)):
            with torch.inference_mode(False):  # its tensors (inv_freq) keep version counters, as the weights'
                self.fused, self.stack = backend, self._stack()
        if self.cuda_graphs and backend.capabilities.graph_safe:
            device = self.context.device
            self.write_graphs = PaddedGraphs(self.write_context, WRITE_GRAPH_ROWS, device)
            self.draft_graphs = PaddedGraphs(self.draft, DRAFT_GRAPH_BATCH, device)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> DraftProposal:
        rows, k = inputs.rows, inputs.k
        batch, dev = inputs.last_tokens.shape[0], inputs.last_tokens.device
        if rows is None:
            raise RuntimeError("the dspark drafter needs the step's rows (DraftInputs.rows); the engine "
                               "provides them when the model captures the drafter's target layers")
        if self.linear is None:
            self._bind(rows)
        # Every committed row (prefill chunks included) enters the context cache before any request drafts; while
        # no request drafts (every one paused) nothing reads the cache, so the rows wait and are written in order
        # (a graph replay's slots and positions are its static buffers: a waiting step's are copied).
        if batch == 0:
            self.pending.append((rows.hidden, rows.ctx.slot_mapping.clone(), rows.ctx.positions.clone()))
            self.pending_rows += rows.hidden.shape[0]
            if self.pending_rows > PENDING_ROWS:
                self._write_pending()
            empty = torch.empty(0, k, device=dev)
            return DraftProposal(empty.long(), None, empty)
        self.pending.append((rows.hidden, rows.ctx.slot_mapping, rows.ctx.positions))
        self._write_pending()
        slots, visible = self.window_slots(rows, inputs.positions - 1)
        # Padding requests: a window on slot 0 that nothing sees, the token 0 at position 1, greedy.
        drafting = [(slots, 0), (visible, False), (inputs.last_tokens, 0), (inputs.positions, 1),
                    (inputs.temperature, 0.0), (inputs.seeds, 0)]
        graphs = self._own_graphs(self.draft_graphs)
        out = graphs(batch, drafting, k, inputs.sampling) if graphs is not None else None
        if out is None:
            return DraftProposal(*self.draft(*(t for t, _ in drafting), k, inputs.sampling))
        # A graph's outputs live until the next replay of the drafter's graphs; the proposal may outlast it.
        return DraftProposal(*(None if t is None else t.clone() for t in out))


def pool_slots(model: Any) -> int:
    """Slots of the main pool (blocks × block size), read from the first paged cache bound to the model's
    layers (``bind_cache``): the context cache is indexed by the main cache's slots. A paged cache is a
    layer's ``kv_cache`` ``[blocks, block size, …]``, or on a hybrid pool (DeepSeek-V4) a compressor's
    ``paged`` entries ``[blocks, block size / ratio, width]`` (one per ``ratio`` positions)."""
    for module in model.modules():
        cache = getattr(module, "kv_cache", None)
        if isinstance(cache, tuple | list) and cache and isinstance(cache[0], torch.Tensor) and cache[0].dim() >= 2:
            return cache[0].shape[0] * cache[0].shape[1]
        paged, ratio = getattr(module, "paged", None), getattr(module, "ratio", None)
        if isinstance(paged, torch.Tensor) and paged.dim() == 3 and isinstance(ratio, int):
            return paged.shape[0] * paged.shape[1] * ratio
    raise ConfigError("plugins.spec_decode.drafter='dspark' needs the model's paged KV cache bound before the "
                      "drafter is built")


def drafter_dtype(model: Any, config: SpecDecodeConfig) -> torch.dtype:
    """The drafter's dtype: ``dspark_dtype``, or the target's (its embedding's) for ``auto``."""
    if config.dspark_dtype == "auto":
        return model.embed_tokens.weight.dtype
    return getattr(torch, config.dspark_dtype)


def context_bytes_per_slot(model: Any, config: SpecDecodeConfig) -> int:
    """Bytes of the context cache per main-pool slot (``DSparkDrafter.context``): every drafter layer's key
    and value row, in the drafter's dtype. The engine counts them in the KV budget before sizing the pool."""
    return config.dspark_num_layers * 2 * model.embed_tokens.weight.shape[1] * drafter_dtype(model, config).itemsize


def lm_head_of(model: Any) -> torch.Tensor:
    """The model's LM head weight ``[V, H]`` (its embedding table when tied)."""
    head = getattr(model, "lm_head", None)
    return model.embed_tokens.weight if head is None else head


def target_layers(config: SpecDecodeConfig, num_layers: int) -> list[int]:
    """The configured target layers, or the default ones for a model of ``num_layers``."""
    ids = config.dspark_target_layer_ids
    return list(ids) if ids is not None else default_target_layers(num_layers)


def check_config(config: SpecDecodeConfig, info: EngineInfo) -> None:
    """Start-up checks of the ``dspark`` fields against the model (``ConfigError`` naming the field)."""
    layers = target_layers(config, info.num_layers)
    if not layers or any(not 0 <= i <= info.num_layers for i in layers) or len(set(layers)) != len(layers):
        raise ConfigError(f"plugins.spec_decode.dspark_target_layer_ids must be distinct layer ids in "
                          f"[0, {info.num_layers}] (the model has {info.num_layers} layers), got {layers}")
    noise = config.dspark_noise_token_id
    if noise is not None and noise >= info.vocab_size:
        raise ConfigError(f"plugins.spec_decode.dspark_noise_token_id ({noise}) must be below the vocabulary size "
                          f"({info.vocab_size})")


def build_network(model: Any, config: SpecDecodeConfig, num_targets: int, draft_vocab_size: int | None = None,
                  separate_context: bool = True) -> DSparkNetwork:
    """An unfilled network sized for ``model`` (its hidden size, vocabulary and device; the dtype of
    ``drafter_dtype``), proposing from a draft vocabulary of ``draft_vocab_size`` tokens (None: the whole
    vocabulary), with each layer's own context projection ``ctx_kv`` unless ``separate_context`` is false."""
    weight = model.embed_tokens.weight
    hidden = weight.shape[1]
    heads = config.dspark_num_heads
    if hidden % heads or (hidden // heads) % 2:
        raise ConfigError(f"plugins.spec_decode.dspark_num_heads ({heads}) must divide the hidden size ({hidden}) "
                          "into heads of an even size")
    # Built on the CPU, then moved: the layers' default initialization (overwritten by the weights) must not
    # draw from the CUDA generator, whose state an engine's CUDA-graph captures register.
    network = DSparkNetwork(hidden, num_targets, model.vocab_size, num_layers=config.dspark_num_layers, heads=heads,
                            intermediate=config.dspark_intermediate_size or 2 * hidden,
                            markov_rank=config.dspark_markov_rank, dtype=drafter_dtype(model, config),
                            device=torch.device("cpu"),
                            draft_vocab_size=draft_vocab_size, separate_context=separate_context,
                            experts=config.dspark_n_routed_experts,
                            experts_per_token=config.dspark_num_experts_per_tok or 0)
    return network.to(weight.device)


def _read_file(path: str | Path, device: torch.device) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(device))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"plugins.spec_decode.dspark_weights: cannot read {str(path)!r}: {exc}") from None


def load_weights(network: DSparkNetwork, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Fill ``network`` from a safetensors file in the documented layout (every tensor, exact shapes;
    ``state``: the file's tensors when already read)."""
    state = _read_file(path, network.main_proj.weight.device) if state is None else state
    expected = network.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(n for n in set(expected) & set(state) if state[n].shape != expected[n].shape)
    if missing or unexpected or wrong:
        detail = "; ".join(f"{what}: {names[:3]}" for what, names in
                           (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names)
        raise ConfigError(f"plugins.spec_decode.dspark_weights: {str(path)!r} does not fit the drafter "
                          f"configured for this model ({detail})")
    network.load_state_dict(state)
    if network.d2t is not None:
        d2t = network.d2t
        if d2t.min() < 0 or d2t.max() >= network.vocab or torch.unique(d2t).numel() != d2t.numel():
            raise ConfigError(f"plugins.spec_decode.dspark_weights: {str(path)!r} has a d2t map that is not a set of "
                              f"distinct ids in [0, {network.vocab})")
        network.set_draft_vocab(d2t.clone())


def save_weights(network: DSparkNetwork, path: str | Path) -> None:
    """Write ``network``'s weights in the documented layout."""
    save_file({name: t.detach().contiguous().cpu() for name, t in network.state_dict().items()}, str(path))


def build_dspark(model: Any, info: EngineInfo, config: SpecDecodeConfig,
                 auto_weights: Callable[[], Path] | None = None) -> DSparkDrafter:
    """The ``dspark`` drafter for ``model``: weights from ``dspark_weights`` — a file, ``random`` (from the
    engine seed) or ``auto`` (``auto_weights()`` gives the path of this target's trained drafter, training
    it on first use) — and the model told to capture the target layers (the engine then keeps them for
    the drafter)."""
    if not callable(getattr(model, "capture_hidden", None)):
        raise ConfigError(f"plugins.spec_decode.drafter='dspark' needs a model that can capture layer features; "
                          f"{info.architecture} cannot; choose 'ngram'")
    layers = target_layers(config, info.num_layers)
    source = config.dspark_weights
    if source == "auto":
        if auto_weights is None:
            raise ConfigError("plugins.spec_decode.dspark_weights='auto' needs the plugin's drafter cache")
        source = str(auto_weights())
    if source == "random":
        network = build_network(model, config, len(layers))
        init_dummy(network, info.seed)
    else:
        state = _read_file(source, model.embed_tokens.weight.device)
        d2t = state.get("d2t")
        separate = any(name.endswith(".ctx_kv.weight") for name in state)  # files trained before the window lack it
        network = build_network(model, config, len(layers), None if d2t is None else int(d2t.shape[0]), separate)
        load_weights(network, source, state)
    network.eval()
    try:
        model.capture_hidden(layers)
    except ValueError as exc:
        raise ConfigError(f"plugins.spec_decode.drafter='dspark': {exc}; choose 'ngram'") from None
    temps = config.dspark_confidence_temperature
    noise = config.dspark_noise_token_id
    return DSparkDrafter(model, network, model.vocab_size - 1 if noise is None else noise,
                         temps if isinstance(temps, list) else [temps] * info.max_draft,
                         config.dspark_context_window, cuda_graphs=info.cuda_graphs)
