"""Token bitmasks of one engine step, built on the host and applied on the device before sampling.

The host and the device meet here (API.md §3): ``EngineCore.prepare`` creates a ``StepMasks`` for a
step with structured rows; the host fills each row as soon as that request's matcher has accepted every
token before the row's position (at once under the synchronous executor; after post-processing the
previous step under the overlapped one, phase 4); the device's ``sample`` (or speculative
verification, through ``constrain``) waits for the filled mask
(the one wait, like a stream waiting on an event), masks a copy of the logits, samples, and takes
logprobs from the raw logits (API.md §4: logprobs are the model's unconstrained distribution).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from deepinfer.sampling.sampler import SampleResult, SamplingBatch, logprobs_of, sample
from deepinfer.structured.grammar import GrammarCompiler

if TYPE_CHECKING:
    from deepinfer.rows import StepRow

# How long the device waits for the host to fill a step's masks before it reports a stuck engine.
MASK_WAIT_S = 600.0


class StepMasks:
    """Bitmasks of the structured rows of one step.

    ``entries`` pairs each structured step row (``deepinfer/rows.py``; its ``grammar`` handle holds the
    matcher) with its first row among the step's sampled rows. A row that verifies drafts (speculative
    decoding) owns ``1 + len(drafts)`` rows: the positions after its committed tokens and after each
    draft prefix (``TokenMatcher.fill_draft_masks``). ``rows`` lists every masked row. ``live(row)``
    (the engine's) tells whether the row's request is still in the epoch it was scheduled in; a row
    whose request finished or was preempted since is left all-allowed: its tokens are discarded in
    ``process`` anyway.
    """

    def __init__(self, compiler: GrammarCompiler, num_rows: int, entries: list[tuple[StepRow, int]],
                 live: Callable[[StepRow], bool]) -> None:
        self.compiler = compiler
        self.entries = entries
        self.live = live
        self.rows = [first + j for s, first in entries for j in range(1 + len(s.drafts))]
        self.bitmask = compiler.allocate_bitmask(num_rows)
        self._pending = list(range(len(entries)))
        self._ready = threading.Event()
        self.fill_seconds = 0.0  # host time spent filling this step's masks

    @property
    def filled(self) -> bool:
        return self._ready.is_set()

    def try_fill(self) -> bool:
        """Fill every row whose matcher is up to date (host side); True once all rows are filled,
        which releases the device's ``sample``."""
        start = time.perf_counter()
        waiting = []
        for i in self._pending:
            s, first = self.entries[i]
            if not self.live(s):
                continue  # dead row: its result will be dropped
            matcher = s.grammar.matcher if s.grammar is not None else None
            if matcher is None:
                raise RuntimeError(f"request {s.request_id} was scheduled before its grammar was ready")
            if matcher.num_accepted != s.token_slot - s.num_prompt_tokens:
                waiting.append(i)  # the tokens before this row are still on the device
                continue
            if s.drafts:
                matcher.fill_draft_masks(s.drafts, self.bitmask, first)
            else:
                matcher.fill_mask(self.bitmask, first)
        self._pending = waiting
        self.fill_seconds += time.perf_counter() - start
        if not waiting:
            self._ready.set()
        return not waiting

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """Device side: wait for the masks, then a copy of ``logits`` with disallowed tokens at −inf."""
        if not self._ready.wait(MASK_WAIT_S):
            raise RuntimeError(f"grammar masks of a step were not filled within {MASK_WAIT_S:g} s")
        constrained = logits.clone()
        self.compiler.apply_bitmask(constrained, self.bitmask, self.rows)
        return constrained

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """Sample from the masked logits; logprobs from the raw ones."""
        result = sample(self.constrain(logits), replace(batch, num_logprobs=-1))
        if batch.num_logprobs < 0:
            return result
        token_lp, top_lp, top_ids = logprobs_of(logits, result.tokens, batch.num_logprobs)
        return SampleResult(result.tokens, token_lp, top_lp, top_ids)
