"""The built-in synchronous step executor."""

from __future__ import annotations

from deepinfer.interfaces import StepContext
from deepinfer.outputs import RequestOutput


class SyncExecutor:
    """schedule → execute (build inputs, forward, sample) → process, one step at a time."""

    def __init__(self, context: StepContext) -> None:
        self.context = context

    def step(self) -> list[RequestOutput]:
        scheduled = self.context.schedule()
        results = self.context.execute(scheduled)
        return self.context.process(scheduled, results)
