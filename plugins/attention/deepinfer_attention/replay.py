"""The ``bounded`` replay planner: YoCo prefill truncation and bounded state restore (ARCHITECTURE §6,
reference/deepinfer.md §6).

- **Prefill truncation** (``mode`` ``mask`` or ``compact``, reason ``prefill``): on a YoCo model the
  consumer layers' compressed KV depends only on the producers (the shared hidden), so a prompt of L
  tokens needs consumer queries only for its last ``keep_tokens`` positions, the ones whose outputs
  reach a sampled token or the consumer rings decode reads. The plan's floor is ``L − keep_tokens`` and
  its layers the consumers; the model still writes the full-length consumer KV.
- **Bounded restore** (``restore: bounded``, reasons ``prefix_hit`` and ``preempted``): the sliding-window
  state is rebuilt from the last ``keep_tokens`` cached tokens instead of the exact receptive field
  (layers × window), with every sliding window blind below the first replayed token. The replay also
  reaches back to the start of the compressor window before the cached end, so every compressed entry
  written after the hit reads projections of this request. An approximation: results may differ from
  an exact restore once ``keep_tokens`` is below the receptive field.

``restore: exact`` restores like the core's ``exact`` planner; with the defaults (``mode: off``,
``restore: exact``) this planner plans exactly as ``exact`` does.
"""

from __future__ import annotations

from typing import Literal

from deepinfer.interfaces import CacheLayout, ReplayPlan, SchedulableRequest
from deepinfer.ops import ExactReplayPlanner


def windowed(layout: CacheLayout) -> list[int]:
    """The sliding windows of the layers that have one (sliding layers, compressed layers with a window)."""
    return [layer.window for layer in layout.layers
            if layer.window and layer.kind in ("sliding", "compressed")]


def consumers(layout: CacheLayout) -> tuple[int, ...]:
    """The YoCo consumer layers (empty for models without YoCo)."""
    return tuple(i for i, layer in enumerate(layout.layers) if layer.role == "consumer")


def min_keep_tokens(layout: CacheLayout) -> int:
    """The least ``keep_tokens`` that leaves decode a complete window after a rollback of up to
    ``max_backtrack`` tokens: the widest window plus ``max_backtrack`` (reference/deepinfer.md §6)."""
    return max(windowed(layout), default=0) + layout.max_backtrack


class BoundedReplayPlanner:
    """``ReplayPlanner`` for ``plugins.attention.replay`` (see the module docstring). ``mode``: ``off``,
    ``mask`` or ``compact``; ``keep_tokens``: the suffix kept by truncation and replayed by a bounded
    restore; ``restore``: ``exact`` or ``bounded``."""

    def __init__(self, mode: Literal["off", "mask", "compact"], keep_tokens: int,
                 restore: Literal["exact", "bounded"]) -> None:
        self.mode = mode
        self.keep_tokens = keep_tokens
        self.restore = restore
        self._exact = ExactReplayPlanner()

    def plan(self, request: SchedulableRequest, layout: CacheLayout,
             reason: Literal["prefill", "prefix_hit", "preempted"]) -> ReplayPlan:
        computed = request.num_computed_tokens
        if reason == "prefill":
            layers = consumers(layout)
            if self.mode == "off" or not layers:
                return ReplayPlan(first_token=computed, visibility_floor=0, mode="full")
            length = request.num_prompt_tokens + request.num_output_tokens
            return ReplayPlan(first_token=computed, visibility_floor=max(0, length - self.keep_tokens),
                              mode=self.mode, layers=layers)
        if self.restore == "exact" or not windowed(layout):
            return self._exact.plan(request, layout, reason)
        first = computed - self.keep_tokens
        for layer in layout.layers:
            if layer.kind == "compressed":
                # The compressor window before the one holding the cached end feeds the next entry (CSA).
                first = min(first, (computed // layer.ratio - 1) * layer.ratio)
        first = max(0, first)
        return ReplayPlan(first_token=first, visibility_floor=first, mode="full")
