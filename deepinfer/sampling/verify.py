"""Lossless verification of draft tokens (reference/deepinfer.md §4).

Request ``i`` owns ``1 + n_i`` consecutive logits rows: the row of its last committed token, then one
row per draft. Row ``j`` is the target's distribution for the token that draft ``j`` proposes.

- Greedy requests accept a draft when it equals the row's argmax (exact match).
- Sampling requests accept draft ``d`` with probability ``min(1, q(d) / p(d))``, where ``q`` is the
  target's filtered distribution (temperature, top-k, top-p, min-p: exactly what the sampler draws
  from) and ``p`` the draft's (one-hot when the drafter gives none).
- Acceptance is a prefix: the first rejected draft ends it. After ``a`` accepted drafts the request
  emits one more token from row ``a``: on a rejection it is drawn from the normalized residual
  ``max(q − p, 0)``, after all drafts were accepted it is the *bonus* token, drawn from ``q`` exactly
  as the sampler would draw it. A request without drafts therefore samples bitwise as without
  speculation, and the emitted tokens follow the target's distribution (standard rejection sampling).

Every uniform is a counter draw of (seed, the slot the token would take, purpose), so verification is
as batch-independent as sampling. Everything runs on the logits' device without a host sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.sampling.rng import Purpose, uniform
from deepinfer.sampling.sampler import SamplingBatch, filtered_probs, inverse_cdf, logprobs_of, row_argmax, sample


@dataclass(frozen=True)
class VerifyBatch:
    """Per-request verification inputs, ``[R]`` or ``[R, K]`` tensors on the logits' device.

    ``row_start`` is each request's first row in the verified logits; ``drafts`` holds the draft ids
    (−1 padded to ``K``), ``num_drafts`` how many are real; ``draft_probs [R, K, V]`` or None for
    one-hot drafts. ``random_requests`` indexes the requests that sample (temperature > 0; host-built,
    so only they pay for the target's sorted distribution; the others verify by exact match);
    ``temperature``/``top_k``/``top_p``/``min_p``/``seeds`` are per request (temperature 1 for greedy
    ones, never used). ``base`` is the
    RNG counter of each request's first emitted token (the sampler's ``positions``); its ``j``-th
    emitted token uses ``base + j``. ``sampling`` draws the final token (shifted by the accepted count
    at run time). ``row_request``/``row_offset`` map every
    verified row to its request and its offset ``j`` within the request. ``forced [R, K+1]`` (None
    when no request has one): the token each position must emit (``SamplingParams.golden_token_ids``,
    −1 = none); a draft at a forced position is accepted exactly when it equals the forced token, and
    a forced final position emits the forced token (the reference's golden-token rule).
    """

    row_start: torch.Tensor
    drafts: torch.Tensor
    num_drafts: torch.Tensor
    draft_probs: torch.Tensor | None
    random_requests: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    base: torch.Tensor
    sampling: SamplingBatch
    row_request: torch.Tensor
    row_offset: torch.Tensor
    forced: torch.Tensor | None = None


@dataclass(frozen=True)
class VerifyResult:
    """``tokens [R, K+1]``: the accepted drafts then the final token, −1 after; ``num_accepted [R]``.
    With logprobs requested, per verified row the raw log-probability of the token emitted from it
    (``token_logprobs [T]``) and the top-n (``top_logprobs``/``top_ids [T, n]``)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    token_logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


def _accepted(logits: torch.Tensor, batch: VerifyBatch, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, K]`` bool: whether each draft passes its own test (before the prefix rule), and ``[R, K+1]`` the
    argmax of each request's rows ``0..K`` (a row past the request's is another's: read only up to its
    drafts). ``cols`` is ``arange(K + 1)``. The target distribution ``q`` (a sort over the vocabulary per
    row) is computed for sampling requests only."""
    num_requests, k = batch.drafts.shape
    rows = (batch.row_start.unsqueeze(1) + cols).clamp_(max=logits.shape[0] - 1)
    argmax = row_argmax(logits).index_select(0, rows.reshape(-1)).reshape(num_requests, k + 1)
    cols = cols[:k]
    rows = rows[:, :k]
    drafts = batch.drafts.clamp(min=0)
    ok = argmax[:, :k] == drafts
    r = batch.random_requests
    if r.numel():
        def per_row(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, r).repeat_interleave(k)

        row_logits = logits.index_select(0, rows.index_select(0, r).reshape(-1))
        d = drafts.index_select(0, r).reshape(-1, 1)
        q = filtered_probs(row_logits, per_row(batch.temperature), per_row(batch.top_k), per_row(batch.top_p),
                           per_row(batch.min_p))
        q_d = q.gather(-1, d).squeeze(-1).to(torch.float64)
        if batch.draft_probs is None:
            p_d = torch.ones_like(q_d)
        else:
            p_d = batch.draft_probs.index_select(0, r).reshape(r.numel() * k, -1).gather(-1, d).squeeze(-1)
            p_d = p_d.to(torch.float64)
        positions = (batch.base.index_select(0, r).unsqueeze(1) + cols).reshape(-1)
        u = uniform(per_row(batch.seeds), positions, Purpose.ACCEPT)
        ok = ok.index_copy(0, r, (u * p_d < q_d).reshape(-1, k))
    return ok & (cols < batch.num_drafts.unsqueeze(1)), argmax


def _residual_tokens(final_logits: torch.Tensor, batch: VerifyBatch, accepted: torch.Tensor) -> torch.Tensor:
    """For the sampling requests (``batch.random_requests``, in that order): a draw from
    ``max(q − p, 0)`` at each one's final row (meaningful where a draft was rejected); falls back to
    ``q`` when the residual has no mass (only possible through rounding)."""
    r = batch.random_requests
    accepted = accepted.index_select(0, r)
    q = filtered_probs(final_logits.index_select(0, r), batch.temperature.index_select(0, r),
                       batch.top_k.index_select(0, r), batch.top_p.index_select(0, r), batch.min_p.index_select(0, r))
    u = uniform(batch.seeds.index_select(0, r), batch.base.index_select(0, r) + accepted, Purpose.RESAMPLE)
    if batch.drafts.shape[1] == 0:
        return inverse_cdf(q, u)
    at = accepted.clamp(max=batch.drafts.shape[1] - 1).unsqueeze(1)
    if batch.draft_probs is None:
        rejected = batch.drafts.index_select(0, r).gather(1, at).clamp(min=0)
        p = torch.zeros_like(q).scatter_(-1, rejected, 1.0)
    else:
        probs = batch.draft_probs.index_select(0, r)
        p = probs.gather(1, at.unsqueeze(-1).expand(-1, 1, q.shape[-1])).squeeze(1).to(q.dtype)
    residual = (q - p).clamp_(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return inverse_cdf(torch.where(empty, q, residual), u)


def verify(logits: torch.Tensor, batch: VerifyBatch, raw_logits: torch.Tensor | None = None) -> VerifyResult:
    """Verify every request's drafts against ``logits [T, V]`` (float32; rows as in ``VerifyBatch``;
    already grammar-masked for structured requests). Logprobs come from ``raw_logits`` when given (the
    model's unconstrained distribution, API.md §4), else from ``logits``."""
    num_requests, k = batch.drafts.shape
    cols = torch.arange(k + 1, device=logits.device)
    if k:
        ok, argmax = _accepted(logits, batch, cols)
    else:
        ok, argmax = torch.zeros(num_requests, 0, dtype=torch.bool, device=logits.device), None
    if batch.forced is not None and k:
        forced = batch.forced[:, :k]
        ok = torch.where(forced >= 0, batch.drafts == forced, ok) & (cols[:k] < batch.num_drafts.unsqueeze(1))
    num_accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)
    at_accepted = num_accepted.unsqueeze(1)
    r = batch.random_requests
    if argmax is not None and not batch.sampling.random_rows.numel() and not r.numel():
        # Every request is greedy: its final token is the argmax of its row ``num_accepted``, computed above
        # (what ``sample`` would return for that row).
        final = argmax.gather(1, at_accepted).squeeze(1)
    else:
        final_logits = logits.index_select(0, batch.row_start + num_accepted)
        shift = num_accepted.index_select(0, batch.sampling.random_rows)
        shifted = dataclasses.replace(batch.sampling, positions=batch.sampling.positions + shift, forced=None)
        bonus = sample(final_logits, dataclasses.replace(shifted, num_logprobs=-1)).tokens
        final = bonus
        if r.numel():
            rejected = num_accepted.index_select(0, r) < batch.num_drafts.index_select(0, r)
            picked = torch.where(rejected, _residual_tokens(final_logits, batch, num_accepted),
                                 bonus.index_select(0, r))
            final = bonus.index_copy(0, r, picked)
    if batch.forced is not None:
        at = batch.forced.gather(1, at_accepted).squeeze(1)
        final = torch.where(at >= 0, at, final)
    # The accepted drafts, then the final token at column ``num_accepted``, −1 after.
    padded = torch.cat([batch.drafts, batch.drafts.new_full((num_requests, 1), -1)], dim=1)
    tokens = torch.where(cols < at_accepted, padded, -1).scatter_(1, at_accepted, final.unsqueeze(1))
    if batch.sampling.num_logprobs < 0:
        return VerifyResult(tokens, num_accepted)
    targets = tokens[batch.row_request, batch.row_offset].clamp(min=0)
    raw = logits if raw_logits is None else raw_logits
    token_lp, top_lp, top_ids = logprobs_of(raw, targets, batch.sampling.num_logprobs)
    return VerifyResult(tokens, num_accepted, token_lp, top_lp, top_ids)
