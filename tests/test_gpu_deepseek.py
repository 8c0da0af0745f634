"""DeepSeek-V3/V2 on CUDA in bf16 against fp32 CPU references (run on the lent H200: ``pytest -m gpu``).

The same harness as ``tests/test_gpu.py`` (whose helpers this module imports): teacher-forced logits
through the real prefill and paged-latent decode path, one request at a time, batched, with chunked
prefill, fp32 on the device, and a free greedy run. The references in ``tests/gpu_refs_deepseek/`` are
made on CPU by ``scripts/make_gpu_refs_deepseek.py`` from the tiny configs of
``tests/test_deepseek_v3.py`` (``v3-yarn``: q_lora, YaRN + mscale, noaux_tc with a non-zero
correction bias; ``v2-grouped``: no q_lora, softmax ``group_limited_greedy``, V2 YaRN).

Tolerances: the scheme of ``tests/test_gpu.py`` (1.5x transformers' own bf16 worst case, never below
``BF16_REL_TOL``/``BF16_RMS_TOL``), with transformers' bf16 worst measured per model on these very
rows and stored in ``ref.pt`` (``hf_bf16_err``). With MoE routing, bf16 rounding can flip an expert
choice at a near-tie, which moves a row more than in a dense model: transformers' bf16 v2-grouped
reaches 0.061 x max|ref| (so its bound is 0.092), v3-yarn 0.030 (bound 0.06).
Measured for the engine (worst over prompts x single/batched/chunked): see ``MEASURED_*`` below.

Routing-margin exclusion (v3-yarn only; v2-grouped is checked on every row as before, and passes).
``ref.pt`` stores per row the fp32 routing margin at the row's own position (``routing_margin``: min over
the MoE layers of the kept/dropped group-score gap and of the k-th/(k+1)-th selection-score gap, see
``scripts/make_gpu_refs_deepseek.py``). The bf16 logit tests skip v3-yarn rows whose margin is below
``MARGIN_MIN = 0.046``: the largest shift of any single selection or group score that bf16 rounding
causes (transformers' bf16 vs fp32 routers on these very sequences, CPU) is 0.023, so a gap of
2 x 0.023 cannot close. The H200 flip (prompt 1, row 13) sits at a margin of 0.023. This keeps 45 of
the 68 v3-yarn rows (66 %); the tests assert at least half remain.
Not excluded: flips at *earlier* positions in the first MoE layer, which reach a row through the last
layer's attention (forcing one such flip in fp32 moves later rows by up to 0.74 x max|ref|). Their
margin (``routing_margin_context``, min over positions <= the row) is 0.001-0.020 on every v3-yarn row,
below the bf16 score shift, so filtering on it would leave no row at all; bf16 on CPU (transformers
and the engine) and on the H200 stays within 0.03 on all rows but that one, so such flips, if any, have
not mattered here. A change that fails only at an earlier-position near-tie is to be read the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_gpu import (
    BF16_REL_TOL,
    BF16_RMS_TOL,
    DEVICE,
    FP32_REL_TOL,
    _compare,
    check_free_greedy,
    load_ref,
    teacher_forced_logits,
)

REFS = Path(__file__).parent / "gpu_refs_deepseek"
NAMES = ("v2-grouped", "v3-yarn")
# fp32 routing margin below which a bf16 row is not compared (see the module docstring), per model;
# a model not named is compared on every row.
MARGIN_MIN = {"v3-yarn": 0.046}
MIN_KEPT = 0.5
# Engine bf16 vs fp32 reference, worst over the prompts x single/batched/chunked (max, RMS), 2026-11-29:
# CPU bf16: v2-grouped 0.060, 0.024; v3-yarn 0.029, 0.023. H200: v2-grouped 0.060, 0.024 (passes);
# v3-yarn FAILS at prompt 1, row 13 (position 29) only: 0.578 x max|ref|, because bf16 on CUDA flips the
# last MoE layer's group choice there (experts (4, 7) instead of (0, 2); the fp32 group-score margin at
# that position is 0.023). Every other row of that prompt is within 0.029. A routing near-tie, not an
# engine bug (fp32 on the device: 1.6e-6); that row's own routing margin is 0.023 < MARGIN_MIN, so it is
# skipped (45 of 68 rows compared); with the exclusion all 36 GPU tests pass on the H200.
# fp32 on the H200: <= 1.6e-6 (max), 1.3e-6 (RMS).

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def robust_rows(ref: dict[str, Any], ours: list[torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``ref`` and ``ours`` cut to the rows whose fp32 routing margin is at least ``MARGIN_MIN`` (prompts
    left without a row are dropped); asserts that at least ``MIN_KEPT`` of the rows remain."""
    threshold = MARGIN_MIN.get(ref["name"])
    if threshold is None:
        return ref, ours
    keep = [m >= threshold for m in ref["routing_margin"]]
    kept = sum(int(k.sum()) for k in keep)
    total = sum(k.numel() for k in keep)
    assert kept >= MIN_KEPT * total, f"{ref['name']}: only {kept} of {total} rows have routing margin >= {threshold}"
    idx = [i for i, k in enumerate(keep) if k.any()]
    cut = {**ref, "prompts": [ref["prompts"][i] for i in idx], "logits": [ref["logits"][i][keep[i]] for i in idx]}
    print(f"\n{ref['name']}: comparing {kept} of {total} rows (routing margin >= {threshold})")
    return cut, [ours[i][keep[i]] for i in idx]


def tolerances(ref: dict[str, Any]) -> tuple[float, float]:
    hf_max, hf_rms = ref["hf_bf16_err"]
    return max(BF16_REL_TOL, 1.5 * hf_max), max(BF16_RMS_TOL, 1.5 * hf_rms)


@pytest.fixture(scope="module", params=NAMES)
def ref(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_ref(REFS / request.param, "scripts/make_gpu_refs_deepseek.py")


def test_bf16_teacher_forced_logits_one_request_at_a_time(ref: dict[str, Any]) -> None:
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE,
                                 one_call=False)
    _compare(*robust_rows(ref, ours), *tolerances(ref), "bf16 single")


def test_bf16_teacher_forced_logits_batched(ref: dict[str, Any]) -> None:
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE)
    _compare(*robust_rows(ref, ours), *tolerances(ref), "bf16 batched")


def test_bf16_teacher_forced_logits_chunked_prefill(ref: dict[str, Any]) -> None:
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE,
                                 max_num_batched_tokens=24)
    _compare(*robust_rows(ref, ours), *tolerances(ref), "bf16 chunked (budget 24)")


def test_fp32_on_device_teacher_forced_logits(ref: dict[str, Any]) -> None:
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="float32", device=DEVICE)
    _compare(ref, ours, FP32_REL_TOL, FP32_REL_TOL, "fp32 batched")


def test_bf16_free_greedy_tokens_match_reference(ref: dict[str, Any]) -> None:
    """No forcing, all prompts batched: greedy tokens equal the fp32 continuation at clear-margin rows
    (margin > 2 x the bf16 bound), until the first near-tie where they part."""
    rel_tol, _ = tolerances(ref)
    check_free_greedy(ref, rel_tol)
