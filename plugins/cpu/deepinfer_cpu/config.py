"""The plugin's config section: ``plugins.cpu``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CPUConfig(BaseModel):
    """``plugins={"cpu": {"enabled": True}}`` offers the ``onednn`` GEMM backend (op ``linear``), which
    ``kernels.gemm: auto`` then takes on CPU runs in float32."""

    model_config = ConfigDict(extra="forbid")

    min_rows: int | None = Field(None, ge=1, description=(
        "calls with at least this many rows run oneDNN on the packed weight; fewer rows (decode steps of a few "
        "requests, a batch-1 verification step) run the C GEMV (gemv.py) on the plain weight, which streams it "
        "once for every row and sums each row as if alone, and the fused decode step takes the steps of fewer "
        "rows. None: 13 for float32 (on the 2-core Xeon VM the GEMV, which asks for the weight 3 KB ahead, beat "
        "oneDNN up to 12 rows: 24.9 against 32.7 ms a SmolLM2 step's projections at 8, a batch-8 decode 1.27x "
        "faster end to end; 7 before the prefetch, when it lost at 8 on an AMD VM), 33 for bfloat16 on a CPU "
        "with AMX-BF16 (its tiles serve up to 32 rows in one pass over the weight: 17-32 rows 18.8-20.8 ms a "
        "SmolLM2 step against oneDNN's 26.5-28.1), else 7 (docs/benchmarks.md)"))
    pack_rows: int = Field(16, ge=1, description=(
        "the row count oneDNN chooses the packed weight layout for (any row count can use it)"))
    fused_decode: bool = Field(True, description=(
        "a Llama-family model's whole decoder stack runs in one C call (csrc/decode_step.c: the GEMM backend's "
        "own kernels, cpu_paged's attention, norms, rope and SiLU between them in C) instead of ~1,400 small "
        "torch ops a step: steps of fewer than min_rows rows under onednn, of fewer than quant_dense_rows "
        "rows under model.quantization; needs the cpu_paged attention backend"))
    fused_draft: bool = Field(True, description=(
        "a block drafter's (spec_decode's dspark) context write and greedy block pass each run in one C call "
        "(csrc/draft_step.c) instead of ~260 small torch ops a drafting step, for calls of fewer than min_rows "
        "rows under onednn (a batch-1 step: 4.4 -> 2.6 ms on the 2-core Xeon, docs/benchmarks.md)"))
    huge_pages: bool = Field(True, description=(
        "the GEMM backends copy the weights they prepare into anonymous memory advised MADV_HUGEPAGE (2 MB "
        "pages): a batch-1 step streams every weight, and 4 KB pages cost a TLB miss every 4 KB (huge_pages.py)"))
    quant_dense_rows: int = Field(8, ge=1, description=(
        "under model.quantization, calls with at least this many rows run oneDNN's float32 GEMM on the weights "
        "rounded to the format; fewer rows (decode steps of a few requests, a request's verification rows) run "
        "the quantized kernel, which on this project's 2-core AVX-512 VM beat oneDNN up to 4 rows and lost from "
        "8 on (docs/benchmarks.md)"))
    quant_inputs: Literal["int8", "float32"] = Field("int8", description=(
        "under model.quantization, what the quantized kernel multiplies the weights with: int8 quantizes each "
        "block of 32 inputs (step max|x| / 127) and runs integer dot products, as llama.cpp does for its Q4_1 / "
        "Q8_0 weights; float32 multiplies the inputs as they are (weight-only quantization, slower)"))
