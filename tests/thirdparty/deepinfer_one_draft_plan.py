"""A third-party verification plan for tests: verify exactly the first draft of every request."""

from __future__ import annotations

import torch

from deepinfer import hookimpl

CALLS: list[int] = []


class OneDraft:
    def budget(self, stale_confidence: torch.Tensor, cost: object) -> int:
        return stale_confidence.shape[0] + int((stale_confidence[:, 0] > 0).sum())

    def split(self, confidence: torch.Tensor, total: int) -> torch.Tensor:
        CALLS.append(total)
        return (confidence[:, 0] > 0).long()


@hookimpl
def deepinfer_verification_plans() -> dict[str, OneDraft]:
    return {"one_draft": OneDraft()}
