"""``oracle``: a drafter for tests and benchmarks — it knows the answer and lies on purpose.

NOT a real drafter. It is given known token sequences (``oracle_file``: JSONL lines
``{"token_ids": [...]}``, e.g. recorded greedy outputs, prompt included). For a request whose history
is a prefix of a known sequence it proposes the next tokens of that sequence; otherwise it proposes
copies of the last token. Each draft is replaced by a different token at rate ``corruption`` (a
counter draw of the request's seed and the draft's position), so the accept, reject, resample and
bonus paths of verification all run on any model, random weights included.

With ``draft_probs`` it reports a smoothed distribution ``p = (1 − ε)·onehot(t) + ε/V`` around the
token ``t`` it would have proposed and *draws* the draft from ``p`` (so verification stays lossless).
Its raw confidence is ``1 − corruption`` for every draft.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from deepinfer.interfaces import DraftInputs, DraftProposal
from deepinfer.ops import Purpose, uniform

SMOOTHING = 0.1
KEY_LEN = 16  # sequences are indexed by their first KEY_LEN ids, so a lookup scans only those that share them


def read_sequences(path: str | Path) -> list[list[int]]:
    """The known sequences of an oracle file."""
    lines = Path(path).read_text().splitlines()
    return [list(json.loads(line)["token_ids"]) for line in lines if line.strip()]


class OracleDrafter:
    """Known continuations with planted corruptions (for tests and benchmarks only)."""

    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int, corruption: float,
                 draft_probs: bool) -> None:
        self.sequences = [tuple(s) for s in sequences]
        self._by_key: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for seq in self.sequences:
            self._by_key.setdefault(seq[:KEY_LEN], []).append(seq)
        self.vocab_size = vocab_size
        self.corruption = corruption
        self.draft_probs = draft_probs

    def _continuation(self, history: list[int], k: int) -> list[int]:
        n = len(history)
        candidates = self._by_key.get(tuple(history[:KEY_LEN]), []) if n >= KEY_LEN else self.sequences
        for seq in candidates:
            if len(seq) > n and list(seq[:n]) == history:
                follow = list(seq[n:n + k])
                return follow + [follow[-1]] * (k - len(follow))
        return [history[-1]] * k

    def propose(self, inputs: DraftInputs) -> DraftProposal:
        k, dev, vocab = inputs.k, inputs.history.device, self.vocab_size
        rows = [[t for t in row if t >= 0] for row in inputs.history.tolist()]  # host-side lookup
        known = torch.tensor([self._continuation(h, k) for h in rows], dtype=torch.int64, device=dev)
        batch = known.shape[0]
        positions = (inputs.positions.unsqueeze(1) + 1 + torch.arange(k, device=dev)).reshape(-1)
        seeds = inputs.seeds.repeat_interleave(k)
        u = uniform(seeds, positions, Purpose.DRAFT).reshape(batch, k)
        shift = 1 + (uniform(seeds, positions + (1 << 40), Purpose.DRAFT) * (vocab - 1)).long().reshape(batch, k)
        target = torch.where(u < self.corruption, (known + shift) % vocab, known)
        confidence = torch.full((batch, k), 1.0 - self.corruption, dtype=torch.float32, device=dev)
        if not self.draft_probs:
            return DraftProposal(target, None, confidence)
        probs = torch.full((batch, k, vocab), SMOOTHING / vocab, dtype=torch.float32, device=dev)
        probs.scatter_add_(-1, target.unsqueeze(-1), torch.full_like(target, 1.0 - SMOOTHING,
                                                                      dtype=torch.float32).unsqueeze(-1))
        draw = uniform(seeds, positions + (2 << 40), Purpose.DRAFT).reshape(batch, k, 1)
        cdf = probs.to(torch.float64).cumsum(dim=-1)
        drafts = torch.searchsorted(cdf, draw * cdf[..., -1:], right=True).squeeze(-1).clamp(max=vocab - 1)
        return DraftProposal(drafts, probs, confidence)
