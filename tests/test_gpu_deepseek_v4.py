"""DeepSeek-V4 on CUDA in bf16 against fp32 CPU references (run on the lent H200: ``pytest -m gpu``).

The harness of ``tests/test_gpu.py``: teacher-forced logits through the real prefill, chunked-prefill
and decode paths (sliding rings and compressor windows in state slots, paged compressed entries), one
request at a time and batched, fp32 on the device, and a free greedy run. The references in
``tests/gpu_refs_deepseek_v4/`` are made on CPU by ``scripts/make_gpu_refs_deepseek_v4.py`` from the
``v4-gpu`` config of ``tests/test_deepseek_v4.py`` (no indexer or router near-ties: see there).
Tolerances: 1.5 x transformers' own bf16 worst case on these rows (``hf_bf16_err`` in ``ref.pt``,
0.049 max / 0.031 RMS on CPU), never below ``BF16_REL_TOL``/``BF16_RMS_TOL``.

Also: a V4-shaped dummy model (hidden 4096, 64 heads of 512, CSA/HCA at ratios 4/128 with the real
indexer sizes, 4 hyper-connection streams, 8 layers, 64 experts) generates on the GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deepseek_v4 import SEQS
from test_gpu import BF16_REL_TOL, BF16_RMS_TOL, DEVICE, FP32_REL_TOL, _compare, check_free_greedy, load_ref
from test_gpu import teacher_forced_logits as _teacher_forced

from deepinfer import LLM, SamplingParams

REFS = Path(__file__).parent / "gpu_refs_deepseek_v4"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def teacher_forced_logits(*args: Any, **kw: Any) -> list[torch.Tensor]:
    return _teacher_forced(*args, max_num_seqs=SEQS, **kw)  # state slots for 8 requests fit KV_BYTES


def tolerances(ref: dict[str, Any]) -> tuple[float, float]:
    hf_max, hf_rms = ref["hf_bf16_err"]
    return max(BF16_REL_TOL, 1.5 * hf_max), max(BF16_RMS_TOL, 1.5 * hf_rms)


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return load_ref(REFS / "v4-gpu", "scripts/make_gpu_refs_deepseek_v4.py")


def test_bf16_teacher_forced_logits_one_request_at_a_time(ref: dict[str, Any]) -> None:
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE,
                                 one_call=False)
    _compare(ref, ours, *tolerances(ref), "bf16 single")


def test_bf16_teacher_forced_logits_batched(ref: dict[str, Any]) -> None:
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE)
    _compare(ref, ours, *tolerances(ref), "bf16 batched")


def test_bf16_teacher_forced_logits_chunked_prefill(ref: dict[str, Any]) -> None:
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE,
                                 max_num_batched_tokens=24)
    _compare(ref, ours, *tolerances(ref), "bf16 chunked (budget 24)")


def test_fp32_on_device_teacher_forced_logits(ref: dict[str, Any]) -> None:
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="float32", device=DEVICE)
    _compare(ref, ours, FP32_REL_TOL, FP32_REL_TOL, "fp32 batched")


def test_bf16_free_greedy_tokens_match_reference(ref: dict[str, Any]) -> None:
    """Greedy tokens of a free bf16 run equal the fp32 continuation at clear-margin rows (margin > 2 x the
    bf16 bound), until the first near-tie where they may part."""
    rel_tol, _ = tolerances(ref)
    compared = check_free_greedy(ref, rel_tol, max_num_seqs=SEQS)
    assert sum(compared) >= len(compared)


# Shared with scripts/bench_replay.py (``--device cuda``), which may not import the tests.
V4_SHAPED = json.loads((Path(__file__).parents[1] / "scripts" / "deepseek_v4_shaped.json").read_text())


def test_v4_shaped_dummy_model_generates(tmp_path: Path) -> None:
    """About 13B parameters of random bf16 weights, built on the device: a 300-token and a 40-token prompt
    (300 > two HCA windows of 128) generate 16 tokens each, in the vocabulary."""
    (tmp_path / "config.json").write_text(json.dumps(V4_SHAPED))
    llm = LLM(tmp_path, load_format="dummy", dtype="bfloat16", device=DEVICE, max_model_len=1024, max_num_seqs=16,
              kernels={"force_balanced_routing": True})
    try:
        gen = torch.Generator().manual_seed(0)
        batch = [torch.randint(2, 129280, (n,), generator=gen).tolist() for n in (300, 40)]
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 16 and all(0 <= t < 129280 for t in ids)
