"""The CPU's feature flags, for tests that build or pick kernels per instruction set (``plugins/cpu``)."""

from __future__ import annotations


def cpu_has(flag: str) -> bool:
    """Whether ``/proc/cpuinfo`` lists ``flag`` (e.g. ``avx512bw``, ``amx_bf16``); False where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False
