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
from deepinfer.ops import Purpose, to_device, uniform

SMOOTHING = 0.1


def read_sequences(path: str | Path) -> list[list[int]]:
    """The known sequences of an oracle file."""
    lines = Path(path).read_text().splitlines()
    return [list(json.loads(line)["token_ids"]) for line in lines if line.strip()]


class OracleDrafter:
    """Known continuations with planted corruptions (for tests and benchmarks only). The lookup runs on
    the history's device (drafting runs on the device between steps): every request's history is
    compared with every known sequence at once."""

    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int, corruption: float,
                 draft_probs: bool) -> None:
        self.sequences = [tuple(s) for s in sequences]
        self.vocab_size = vocab_size
        self.corruption = corruption
        self.draft_probs = draft_probs
        self._table: torch.Tensor | None = None  # [S, L] the sequences, −2 padded (matches no token)
        self._lengths: torch.Tensor | None = None

    def _known(self, history: torch.Tensor, k: int) -> torch.Tensor:
        """``[B, k]``: the next ``k`` tokens of the first known sequence that the request's history
        (``[B, W]`` right-aligned, −1 padded) begins, repeating its last token when it runs out; copies of
        the last token for a request that begins none."""
        dev = history.device
        batch, width = history.shape
        if not self.sequences:
            return history[:, -1:].expand(batch, k).clone()
        if self._table is None or self._table.device != dev:
            longest = max(len(seq) for seq in self.sequences)
            # Built on first use, inside a step: copied without waiting for the device.
            self._table = to_device([[*seq] + [-2] * (longest - len(seq)) for seq in self.sequences], torch.int64, dev)
            self._lengths = to_device([len(seq) for seq in self.sequences], torch.int64, dev)
        table, lengths = self._table, self._lengths
        assert lengths is not None
        if table.shape[1] < width:
            table = torch.cat([table, table.new_full((table.shape[0], width - table.shape[1]), -2)], dim=1)
        n = (history >= 0).sum(dim=1)  # each history's length
        cols = torch.arange(width, device=dev)
        left = history.gather(1, ((width - n).unsqueeze(1) + cols).clamp(max=width - 1))
        beyond = cols.unsqueeze(0) >= n.unsqueeze(1)  # [B, W]: columns past the history
        same = (table[:, :width].unsqueeze(0) == left.unsqueeze(1)) | beyond.unsqueeze(1)  # [B, S, W]
        match = same.all(dim=-1) & (lengths.unsqueeze(0) > n.unsqueeze(1))
        first = match.to(torch.int64).argmax(dim=1)  # the first matching sequence (0 when none)
        at = (n.unsqueeze(1) + torch.arange(k, device=dev)).clamp(max=lengths[first].unsqueeze(1) - 1)
        follow = self._table.index_select(0, first).gather(1, at.clamp(max=self._table.shape[1] - 1))
        return torch.where(match.any(dim=1, keepdim=True), follow, history[:, -1:])

    def propose(self, inputs: DraftInputs) -> DraftProposal:
        k, vocab = inputs.k, self.vocab_size
        history = inputs.history
        dev = history.device
        known = self._known(history, k)
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
