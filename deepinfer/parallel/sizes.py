"""How many ranks a config asks for, and which rank this process is (None outside a rank process).

``expert_parallel_size=N`` alone sets ``data_parallel_size=N`` (API.md §4): N ranks, attention data
parallel (each rank owns its requests) and the routed experts spread over the same N ranks.
``data_parallel_size=N`` alone gives N data-parallel ranks that each hold every expert.
"""

from __future__ import annotations

from typing import Any

from deepinfer.errors import ConfigError

_current_rank: int | None = None


def parallel_sizes(parallel: Any) -> tuple[int, int]:
    """``(world, expert_parallel)`` from a ``ParallelSection``; raises ``ConfigError`` when the two
    sizes disagree (experts are spread over the data-parallel ranks or not at all)."""
    dp, ep = parallel.data_parallel_size, parallel.expert_parallel_size
    if ep > 1 and dp > 1 and ep != dp:
        raise ConfigError(f"parallel.expert_parallel_size ({ep}) must equal parallel.data_parallel_size ({dp}), "
                          "or one of them must be 1: experts are spread over the data-parallel ranks")
    return max(dp, ep), ep


def current_rank() -> int | None:
    """This process's rank when it is a deepinfer rank process, else None."""
    return _current_rank


def set_current_rank(rank: int) -> None:
    """Mark this process as rank ``rank`` (called once by the rank entry point)."""
    global _current_rank
    _current_rank = rank
