"""The plugin's config section: ``plugins.scheduling``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SchedulingConfig(BaseModel):
    """``plugins={"scheduling": {"enabled": True}}`` offers the ``overlap`` executor (chosen by
    ``scheduler.executor: auto``) and the ``priority`` and ``spf`` policies (``scheduler.policy``).

    ``sync_guard``: a debug mode for CUDA runs: any device synchronization in the overlapped
    executor's launch path (building a step's inputs and enqueueing it) raises ``RuntimeError``
    (``torch.cuda.set_sync_debug_mode("error")``, ``sync_guard.py``). No effect without CUDA."""

    model_config = ConfigDict(extra="forbid")

    sync_guard: bool = False
