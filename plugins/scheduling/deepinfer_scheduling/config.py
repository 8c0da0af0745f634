"""The plugin's config section: ``plugins.scheduling``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class SchedulingConfig(BaseModel):
    """``plugins={"scheduling": {"enabled": True}}`` offers the ``overlap`` executor (chosen by
    ``scheduler.executor: auto``) and the ``priority`` and ``spf`` policies (``scheduler.policy``).

    ``sync_guard``: a debug mode for CUDA runs: any device synchronization in the overlapped
    executor's launch path (building a step's inputs and enqueueing it) raises ``RuntimeError``
    (``torch.cuda.set_sync_debug_mode("error")``, ``sync_guard.py``). No effect without CUDA.

    ``launch``: who enqueues a step's device work. ``thread``: a worker thread (the overlap is real on a CPU
    device too, where the forward runs on the host's cores); ``inline``: the host thread itself, before it
    waits for the previous step (CUDA only: the stream keeps the order, and no second Python thread contends
    for the GIL with the host's scheduling and processing)."""

    model_config = ConfigDict(extra="forbid")

    sync_guard: bool = False
    launch: Literal["thread", "inline"] = "thread"
