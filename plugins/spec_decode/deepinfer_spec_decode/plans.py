"""Verification plans: how many drafts each request verifies (API.md §2, reference/deepinfer.md §5).

Both plans rank candidate draft slots globally and take the best ones; a request's slots are ranked
in position order, so a plan never verifies draft ``j + 1`` of a request without draft ``j``. Ties
go to the smaller flat index (request · k + position): the result is deterministic.

- ``fixed``: every request verifies all its drafts (the ranking is by position).
- ``varlen``: the confidence-driven plan. A slot's value is the running product of its request's
  conditional confidences (the probability that it is accepted). ``budget`` walks the slots from
  most to least likely and keeps the total query tokens that maximize expected accepted tokens per
  second of step time (from the step-cost model: forward at the step's graph bucket, the sampler per
  verified row, and the drafting of every request with drafts after the step), against decoding
  without any draft (no drafting charged: when the plan verifies nothing the engine pauses drafting);
  rows of zeros are decode requests without drafts, in the step's tokens but not drafting; ``split``
  gives that total to the best slots of the newest confidences. ``drafting_pays`` asks the same question of
  a typical request at a batch size: where its answer is no (on the 2-core CPU at batch 32, where verified rows
  past the GEMV's 32 and drafting for every request cost more than the expected accepted tokens bring), the
  engine keeps every request's drafting paused, probes included. The typical request offers the mean chance of
  acceptance by position over the drafts recently offered (the running products of their calibrated
  confidences, a decaying mean over ``budget``'s rows), not the acceptance verification observed: varlen
  verifies a later position only where it was surer, so the observed share accepted there given the position
  before (0.8–0.9 on the CPU at batch 8, against ~0.5 over every draft) made drafting look paying where it lost
  5–10%.
"""

from __future__ import annotations

import torch

from deepinfer.interfaces import StepCostModel

FEW_SIZES = 16  # VarlenPlan asks the cost model size by size up to this many candidate totals, at once past it


def take_best(score: torch.Tensor, valid: torch.Tensor, extra: int) -> torch.Tensor:
    """Drafts per request ``[B]``: the ``extra`` valid slots of highest ``score`` (ties: smaller flat
    index), counted per request. ``score`` must not increase along a request's positions."""
    batch, k = score.shape
    if extra <= 0 or not k:
        return torch.zeros(batch, dtype=torch.int64, device=score.device)
    flat = torch.where(valid, score, torch.full_like(score, float("-inf"))).reshape(-1)
    # A stable sort of the negated scores keeps equal scores in flat-index order.
    order = torch.sort(-flat, stable=True).indices
    taken = torch.zeros_like(flat, dtype=torch.bool)
    best = order[:extra]
    taken[best] = torch.isfinite(flat[best])
    return taken.reshape(batch, k).sum(dim=1)


def acceptance_rates(confidence: torch.Tensor) -> torch.Tensor:
    """Running products of conditional confidences: the chance each slot is accepted."""
    return torch.cumprod(confidence.to(torch.float64), dim=1)


class FixedPlan:
    """Verify every draft. The ranking by position needs no sort: a request's drafts are a prefix of its
    row, so the slots of position ``j`` are the requests with more than ``j`` drafts, taken in request order
    (a few host operations per step, where ``take_best`` costs a dozen tensor ops of host time)."""

    def budget(self, stale_confidence: torch.Tensor, cost: StepCostModel) -> int:
        return int(stale_confidence.shape[0] + (stale_confidence > 0).sum())

    def split(self, confidence: torch.Tensor, total: int) -> torch.Tensor:
        counts = (confidence > 0).sum(dim=1).tolist()
        grants = [0] * len(counts)
        left, j = total - len(counts), 0
        while left > 0:
            rows = [i for i, n in enumerate(counts) if n > j][:left]
            if not rows:
                break
            for i in rows:
                grants[i] += 1
            left -= len(rows)
            j += 1
        return torch.tensor(grants, dtype=torch.int64, device=confidence.device)


class VarlenPlan:
    """Confidence-driven variable-length verification (module docstring). ``budget`` keeps a decaying mean of
    the acceptance chances of the drafts it is offered (each call weighs the earlier ones by ``OFFERED_DECAY``),
    which ``drafting_pays`` judges a typical request by."""

    OFFERED_DECAY = 1 - 1 / 64  # a step's weight in the mean after 64 more steps: ~1/e
    MIN_OFFERED = 16  # offered requests (decayed) before drafting_pays judges: True until then
    # drafting_pays wants this much more throughput than plain decoding: the step-cost model's median error is
    # 4–8% on the CPU runs, so a smaller predicted gain is as likely a loss (float32 batch 32: 0.93x)
    PAYS_MARGIN = 0.05

    def __init__(self) -> None:
        self._offered = torch.zeros(0, dtype=torch.float64)  # Σ of offered rows' acceptance chances, decayed
        self._offered_rows = 0.0  # the rows in it, decayed alike

    def drafting_pays(self, batch: int, cost: StepCostModel) -> bool:
        """Whether drafting can pay at a step of ``batch`` decode requests: ``budget`` grants drafts, by more than
        ``PAYS_MARGIN``, when every request offers the mean acceptance chances of the drafts offered so far (True
        until ``MIN_OFFERED`` requests offered drafts)."""
        if self._offered_rows < self.MIN_OFFERED or batch <= 0:
            return True
        chance = self._offered / self._offered_rows
        return self._best(chance.expand(batch, len(chance)), batch, cost, self.PAYS_MARGIN) > batch

    def budget(self, stale_confidence: torch.Tensor, cost: StepCostModel) -> int:
        rates = acceptance_rates(stale_confidence)
        drafting = int((stale_confidence > 0).any(dim=1).sum())  # rows of zeros: decode rows without drafts
        if self._offered.shape != rates.shape[1:]:
            self._offered = torch.zeros(rates.shape[1:], dtype=torch.float64)
        self._offered.mul_(self.OFFERED_DECAY).add_(rates.sum(dim=0))  # a row of zeros adds nothing
        self._offered_rows = self._offered_rows * self.OFFERED_DECAY + drafting
        return self._best(rates, drafting, cost)

    @staticmethod
    def _best(rates: torch.Tensor, drafting: int, cost: StepCostModel, margin: float = 0.0) -> int:
        """``budget``'s answer for the acceptance chances ``rates [B, k]`` of a step's slots, ``drafting`` of its
        ``B`` requests offering drafts: drafts only where they promise more than ``margin`` over the baseline.
        Plain Python over the slots (and ``step_time`` per size for a few sizes): as tensor code it made a dozen
        small ops, each paying cold caches after the forward (~0.5 ms of a CPU step's host time)."""
        batch = rates.shape[0]
        ranked = sorted((r for r in rates.reshape(-1).tolist() if r > 0), reverse=True)
        if not ranked:
            return batch
        # The baseline is decoding without speculation: no draft verified, and none drafted either (the
        # engine pauses drafting after a step that verifies nothing), so no drafting cost.
        baseline = batch / cost.step_time(batch)
        # Taking the best j slots: batch + j tokens, batch + the sum of their rates expected to be emitted.
        sizes = range(batch + 1, batch + len(ranked) + 1)
        if len(sizes) <= FEW_SIZES:
            times = [cost.step_time(q, requests=drafting) for q in sizes]
        else:
            times = cost.step_times(torch.tensor(sizes, dtype=torch.int64), requests=drafting).tolist()
        best, best_rate, expected = batch, 0.0, float(batch)
        for q, rate, seconds in zip(sizes, ranked, times, strict=True):
            expected += rate
            throughput = expected / max(seconds, 1e-12)
            if throughput > best_rate:  # the first of equal maxima: the fewest tokens
                best, best_rate = q, throughput
        return best if best_rate > baseline * (1 + margin) else batch

    def split(self, confidence: torch.Tensor, total: int) -> torch.Tensor:
        return take_best(acceptance_rates(confidence), confidence > 0, total - confidence.shape[0])
