"""``mtp``: a DeepSeek-V3 or -V4 model's multi-token-prediction layer as the drafter, chained for k drafts.

The model's interface (``deepseek_v3.py``, ``deepseek_v4.py``): ``mtp_hidden(hidden, next_ids, positions,
ctx)`` (the MTP layer's output rows, which stand in for the main model's at the next position) and
``mtp_logits(rows, ctx)``. What a hidden row is belongs to the model: V3's final normed hidden state,
V4's final hyper-connection streams (flattened).

Right after every step, on the device, the core hands over the step's rows (``DraftInputs.rows``, a
``CommittedRows``): the main model's final hidden state of every token the step computed, and the token
after each. MTP at position p takes (main hidden at p, embedding of token p + 1), writes its own cache
row at p and predicts token p + 2. One pass over the rows therefore writes the MTP cache row of every
main-model token (prefill chunks included; a rejected draft's row lands past the committed length and
is written again once that position is computed for real), and its output at each drafting request's
last committed row (position n − 2 for a request of n tokens, whose next token is the request's last
token) gives draft 1. Drafts 2..k chain the same layer: its own output hidden stands in for the main
model's at the next position, the previous draft is the next token, and the row lands past the
committed length (``CommittedRows.chain``: the scheduler reserved the blocks); rows of rejected
drafts are overwritten once those positions are committed for real. Only depth 0 runs: DeepSeek-V3 and V4
ship one MTP layer, and a deeper one would need its own catch-up over drafts not yet known.

Drafts: a greedy request takes the argmax; a sampling request draws from ``softmax(logits / T)`` with
its own temperature and the counter RNG (seed, the draft's position, ``Purpose.DRAFT``), so the draft
is as batch-independent as sampling. The proposal reports those distributions (one-hot rows for greedy
requests) so verification stays lossless; when every request is greedy it reports none (one-hot).
The raw confidence of a draft is the drafter's own probability of it (at temperature 1 for a greedy
request); the plugin calibrates it.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.interfaces import DraftInputs, DraftProposal
from deepinfer.ops import Purpose, inverse_cdf, row_argmax, uniform


def choose_drafts(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  sampling: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One draft per row of ``logits [B, V]`` (float32) for tokens at ``positions [B]``.

    Returns ``tokens [B]`` (int64), ``probs [B, V]`` the distribution each was drawn from (one-hot at
    the argmax for greedy rows, ``temperature`` ≤ 0) and ``confidence [B]`` the probability of the
    draft under ``softmax(logits / T)`` (T = 1 for greedy rows). ``sampling`` False (the host knows that
    no request samples, ``DraftInputs.sampling``): every row is greedy, so no draw and no ``probs`` (None):
    a handful of kernels per draft position instead of the draw's hash, cumulative sum and one-hot."""
    if not sampling:
        tokens = row_argmax(logits)
        return tokens, None, torch.softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / scale.unsqueeze(-1), dim=-1)
    argmax = row_argmax(logits)
    drawn = inverse_cdf(probs, uniform(seeds, positions, Purpose.DRAFT))
    tokens = torch.where(greedy, argmax, drawn)
    confidence = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, argmax.unsqueeze(-1), 1.0)
    return tokens, torch.where(greedy.unsqueeze(-1), one_hot, probs), confidence


class MTPDrafter:
    """Chained MTP drafts over the model's ``mtp_hidden`` / ``mtp_logits`` (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> DraftProposal:
        rows = inputs.rows
        if rows is None:
            raise RuntimeError("the mtp drafter needs the step's rows (DraftInputs.rows); the engine "
                               "provides them when plugins.spec_decode.drafter resolves to 'mtp'")
        model, k = self.model, inputs.k
        batch, dev = inputs.last_tokens.shape[0], rows.hidden.device
        # Every committed row writes its MTP cache row; only the drafting requests' last rows go on.
        hidden = model.mtp_hidden(rows.hidden, rows.next_tokens, rows.ctx.positions, rows.ctx)
        tokens = torch.empty(batch, k, dtype=torch.int64, device=dev)
        confidence = torch.empty(batch, k, dtype=torch.float32, device=dev)
        if batch == 0:
            return DraftProposal(tokens, None, confidence)
        probs = torch.empty(batch, k, model.vocab_size, dtype=torch.float32, device=dev) if inputs.sampling else None
        hidden = hidden.index_select(0, rows.last_rows)
        ctx = rows.ctx
        for j in range(k):
            if j:
                # Draft j+1: the MTP row at the position of draft j (offset j−1 from the last token), its
                # own previous output standing in for the main model's hidden there.
                ctx = rows.chain(j - 1)
                hidden = model.mtp_hidden(hidden, tokens[:, j - 1], ctx.positions, ctx)
            logits = model.mtp_logits(hidden, ctx)
            draft, dist, conf = choose_drafts(logits, inputs.temperature, inputs.seeds, inputs.positions + 1 + j,
                                              inputs.sampling)
            tokens[:, j], confidence[:, j] = draft, conf
            if probs is not None and dist is not None:
                probs[:, j] = dist
        return DraftProposal(tokens, probs, confidence)
