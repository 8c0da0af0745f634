"""Shared set-up for the moe plugin's tests.

Without a GPU the Triton kernels run through Triton's CPU interpreter: ``TRITON_INTERPRET=1`` must be
set before the kernels module is imported (``triton.jit`` reads it at decoration time), so it is set
here, at collection. With CUDA present (the lead's H200 runs) the kernels compile for real.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
