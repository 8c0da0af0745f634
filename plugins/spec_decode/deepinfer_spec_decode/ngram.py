"""``ngram``: prompt lookup, a drafter that works with any model.

For each request, the longest n-gram (``ngram_max`` down to ``ngram_min``) that ends its history and
occurred earlier in it is looked up; the tokens that followed its most recent earlier occurrence are
the drafts. Vectorized over the batch on the history's device; no per-token Python loop.

Raw confidence comes from the match statistics: a longer match and more earlier occurrences make the
continuation likelier, ``(n / (n + 1)) · (c / (c + 1))`` for a match of length ``n`` found ``c``
times, the same for every draft position (the calibrator learns how it decays with the position).
"""

from __future__ import annotations

import torch

from deepinfer.interfaces import DraftInputs, DraftProposal


class NgramDrafter:
    """Prompt-lookup drafts (one-hot)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, inputs: DraftInputs) -> DraftProposal:
        history, k = inputs.history, inputs.k
        batch, width = history.shape
        dev = history.device
        tokens = torch.full((batch, k), -1, dtype=torch.int64, device=dev)
        confidence = torch.zeros(batch, k, dtype=torch.float32, device=dev)
        found = torch.zeros(batch, dtype=torch.bool, device=dev)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if width < n + 1:
                continue
            suffix = history[:, width - n:]
            windows = history.unfold(1, n, 1)[:, :-1]  # every earlier window; the suffix itself excluded
            match = (windows == suffix.unsqueeze(1)).all(dim=-1) & (suffix >= 0).all(dim=-1, keepdim=True)
            index = torch.arange(windows.shape[1], device=dev)
            last = torch.where(match, index, -1).amax(dim=-1)
            hit = (last >= 0) & ~found
            positions = (last + n).unsqueeze(1) + torch.arange(k, device=dev)
            follow = history.gather(1, positions.clamp(max=width - 1))
            follow = torch.where(positions < width, follow, -1)
            # Once a continuation runs off the end, later drafts are meaningless too.
            follow = torch.where(torch.cumprod((follow >= 0).to(torch.int64), dim=1).bool(), follow, -1)
            count = match.sum(dim=-1).to(torch.float32)
            score = (n / (n + 1)) * count / (count + 1)
            tokens = torch.where(hit.unsqueeze(1), follow, tokens)
            confidence = torch.where(hit.unsqueeze(1) & (follow >= 0), score.unsqueeze(1), confidence)
            found |= hit
        return DraftProposal(tokens, None, confidence)
