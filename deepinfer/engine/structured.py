"""The engine core's structured-output bookkeeping, kept out of ``EngineCore`` so the step code stays short.

Per step: ``poll`` resolves compilations of waiting requests (failures finish only their request);
``attach`` gives a prepared step its ``StepMasks``; ``commit`` advances a request's matcher by a token
the host has just read; ``fill_pending`` fills the masks of steps prepared before their requests'
previous tokens were known (the overlapped executor's phase 4).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from deepinfer.structured.masks import StepMasks

# Longest wait for a compilation when the engine has nothing else to run (the loop re-checks after it).
IDLE_WAIT_S = 0.05

if TYPE_CHECKING:
    from deepinfer.engine.request import Request
    from deepinfer.engine.runner import StepInputs
    from deepinfer.rows import StepRow


class StructuredRuntime:
    """Masks waiting to be filled, and the polling of compilations."""

    def __init__(self) -> None:
        self.unfilled: list[StepMasks] = []
        self.mask_fill_seconds = 0.0  # host time filling bitmasks, for docs/benchmarks.md
        self.masked_rows = 0

    @staticmethod
    def poll(waiting: Iterable[Request]) -> list[Request]:
        """Waiting requests whose grammar failed to compile or timed out (``grammar.error`` says which)."""
        now = time.monotonic()
        return [r for r in waiting if r.grammar is not None and not r.grammar.poll(now) and r.grammar.error]

    @staticmethod
    def wait_for_compilation(waiting: Iterable[Request], timeout_s: float = IDLE_WAIT_S) -> None:
        """Block up to ``timeout_s`` until one compilation ends, if every request in ``waiting`` waits
        for its grammar. The caller checks that nothing runs, so the compile threads get the CPU instead
        of a spinning step loop; a request that could run is never delayed."""
        waiting = list(waiting)
        if not waiting or not all(r.grammar is not None and not r.grammar.ready for r in waiting):
            return
        wait([r.grammar.future for r in waiting], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def attach(self, inputs: StepInputs, live: Callable[[StepRow], bool]) -> None:
        """Give ``inputs`` the masks of its structured sampler rows (those whose step row has a grammar
        handle) and fill the rows that can be filled; ``live(row)``: the row's request is still in the
        epoch it was scheduled in (``StepMasks``)."""
        entries, row = [], 0
        for s in inputs.samplers:  # a row verifying drafts owns 1 + len(drafts) sampled rows
            if s.grammar is not None:
                entries.append((s, row))
            row += 1 + len(s.drafts)
        if not entries:
            return
        compiler = entries[0][0].grammar.compiler
        masks = StepMasks(compiler, row, entries, live)
        inputs.grammar = masks
        self.masked_rows += len(masks.rows)
        if not self._fill(masks):
            self.unfilled.append(masks)

    def fill_pending(self) -> None:
        """Fill masks whose requests' previous tokens the host has now committed."""
        self.unfilled = [m for m in self.unfilled if not self._fill(m)]

    def _fill(self, masks: StepMasks) -> bool:
        done = masks.try_fill()
        if done:
            self.mask_fill_seconds += masks.fill_seconds
        return done

    @staticmethod
    def commit(req: Request, token: int) -> bool:
        """Advance ``req``'s matcher by its newly committed ``token``. False when the grammar refuses it
        (the sampler draws only allowed tokens, so that means a broken mask): ``grammar.error`` then
        says so, and the engine finishes the request with that error rather than going on silently."""
        if req.grammar is None or req.grammar.matcher is None:
            return True
        if req.grammar.matcher.accept(token):
            return True
        req.grammar.error = f"grammar ({req.grammar.spec.describe()}) refused the sampled token {token}"
        return False

    @staticmethod
    def terminated(req: Request) -> bool:
        """The request's grammar accepted a stop token: generation must end."""
        return req.grammar is not None and req.grammar.matcher is not None and req.grammar.matcher.is_terminated()
