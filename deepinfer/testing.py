"""Test-mode switches that plugins share with the core's tests: public, stable within a minor version.

``triton_interpreting()`` says whether Triton kernels run in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, which the repository's conftest sets when there is no CUDA device). A Triton
backend reads it to declare the CPU device (below the core's CPU backends, so ``auto`` keeps the
reference unless the backend is named) and to route around the interpreter's known faults (its bf16
``tl.dot``); every plugin reads the switch through this one function, so they agree on what it means.
"""

from __future__ import annotations

import os

__all__ = ["triton_interpreting"]


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is ``"1"`` now. Triton reads the variable when a kernel is decorated,
    so it must be set before a kernels module is imported; this reads it at each call."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
