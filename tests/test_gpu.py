"""The engine on CUDA in bf16 against fp32 CPU references (run on the lent H200: ``pytest -m gpu``).

The references in ``tests/gpu_refs/<name>/`` are made on CPU by ``scripts/make_gpu_refs.py``: for each
tiny config of ``tiny_models.py`` the HF folder itself, a few prompts of mixed lengths, the fp32 greedy
continuation of each, and the fp32 transformers logits of every row the engine computes for the
prompt plus ``CONT_LEN`` teacher-forced tokens (rows ``len(prompt) - 1 ... len(prompt) + CONT_LEN - 1``).

Teacher forcing: we run ``generate(max_tokens=CONT_LEN + 1, temperature=0)`` and wrap the runner's
``execute`` so that each sampled token is replaced by the reference continuation's token before the
host appends it (``force_tokens``). The engine thus goes through its real prefill and paged-KV decode
path (one prefill step, then ``CONT_LEN`` decode steps, or prefill chunks with a small token budget)
on exactly the token sequence the reference saw, so every one of the ``CONT_LEN + 1`` logits rows can
be compared, and a bf16 argmax flip at a near-tie does not end the comparison. The logits are
captured with ``tiny_models.record_logits`` (the rows of the LM head that sampling reads). A separate
test lets the engine run free (no forcing) and compares its greedy tokens with the reference.

Tolerances. These tiny models have large random weights (std 0.15), logits up to |x| of about 4.5-5.6,
and bf16 (8 mantissa bits) rounds the weights, activations and KV cache, so bf16 logits honestly
differ from fp32 by a few percent of the largest logit: on CPU, transformers' own bf16 model differs
from the fp32 reference by up to 0.040 x max|ref| (max) and 0.026 (RMS over the rows, relative to the
reference's RMS); rounding only the weights to bf16 already gives 0.025 (max). Per prompt we assert

- ``max |Δ| <= BF16_REL_TOL * max|ref|`` with ``BF16_REL_TOL = 0.06`` (1.5x transformers' bf16 worst), and
- ``rms(Δ) <= BF16_RMS_TOL * rms(ref)`` with ``BF16_RMS_TOL = 0.04``.

A real bug is far outside: one missing key (the first prompt token dropped) moves the logits by
0.19-0.94 x max|ref| on these prompts. Greedy tokens (the argmax of the engine's logits, and the tokens
of a free run) are compared only at rows whose reference top-2 margin exceeds ``2 * BF16_REL_TOL *
max|ref|``: with every logit within the tolerance, such a gap cannot close. fp32 on the device is
checked too (``FP32_REL_TOL``), so a device-only engine bug is not hidden behind bf16 noise.
Measured values for the engine: see the constants below.

Every test is marked ``gpu`` (deselected by the default ``-m 'not gpu'``) and is skipped without CUDA.
``DEEPINFER_GPU_TEST_DEVICE=cpu`` runs them on CPU instead (bf16 on CPU: a preview of the harness).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import TINY, record_logits

from deepinfer import LLM, SamplingParams
from deepinfer.model.transfer import to_host
from deepinfer.sampling.sampler import SampleResult

REFS = Path(__file__).parent / "gpu_refs"
CONT_LEN = 16  # teacher-forced tokens after each prompt; CONT_LEN + 1 logits rows per prompt
PROMPT_LENGTHS = (5, 17, 33, 70)  # below, at and across 16-token block boundaries
PROMPT_SEED = 1234
KV_BYTES = 1 << 23
BLOCK_SIZE = 16
# Engine bf16 vs the fp32 reference, worst over the four models x four prompts x single/batched/chunked:
# CPU bf16 max 0.037, RMS 0.026; H200 (2026-11-29) max 0.037, RMS 0.026.
BF16_REL_TOL = 0.06
BF16_RMS_TOL = 0.04
# Engine fp32 on the device vs fp32 transformers on CPU: CPU 1.2e-6; H200 2.4e-6 (max), 1.8e-6 (RMS).
FP32_REL_TOL = 1e-4

DEVICE = os.environ.get("DEEPINFER_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def make_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def force_tokens(llm: LLM, forced: dict[tuple[int, ...], Sequence[int]]) -> None:
    """Patch ``llm`` so a request whose prompt is a key of ``forced`` gets ``forced[prompt][i]`` as
    its i-th output token, whatever the sampler chose (past the end of the list the sampler's token
    stays). The logits are untouched: only the token appended to the sequence is replaced."""
    runner, engine = llm.engine.runner, llm.engine
    execute, add = runner.execute, engine.add
    prompts: dict[str, tuple[int, ...]] = {}  # step rows name their request; its prompt is noted here

    def add_noting(request: Any) -> None:
        prompts[request.request_id] = tuple(request.prompt_token_ids)
        add(request)

    def execute_forced(inputs: Any, *args: Any) -> Any:
        results = execute(inputs, *args)
        if results.sampled is not None:
            tokens = results.sampled.tokens.clone()
            for row, s in enumerate(results.samplers):
                teacher = forced.get(prompts[s.request_id], ())
                i = s.token_slot - s.num_prompt_tokens  # this step produces output token i
                if i < len(teacher):
                    tokens[row] = teacher[i]
            results.sampled = SampleResult(tokens, results.sampled.token_logprobs, results.sampled.top_logprobs,
                                           results.sampled.top_ids)
            if results.host_sampled is not None:  # on CUDA the engine reads the copy started in ``execute``
                results.host_sampled = to_host(results.sampled)
        return results

    runner.execute = execute_forced
    engine.add = add_noting


def teacher_forced_logits(folder: Path, prompts: list[list[int]], forced: list[list[int]], *, dtype: str,
                          device: str, one_call: bool = True, **overrides: Any) -> list[torch.Tensor]:
    """Per prompt, the engine's ``[len(forced) + 1, vocab]`` float32 logits (on CPU) with the outputs
    forced to ``forced``. ``one_call``: all prompts in one ``generate`` (batched), else one call each."""
    llm = LLM(folder, dtype=dtype, device=device, kv_cache_bytes=KV_BYTES, block_size=BLOCK_SIZE, **overrides)
    try:
        steps = record_logits(llm)
        force_tokens(llm, {tuple(p): f for p, f in zip(prompts, forced, strict=True)})
        params = SamplingParams(temperature=0, max_tokens=len(forced[0]) + 1, ignore_eos=True)
        if one_call:
            outs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        rows: dict[str, list[torch.Tensor]] = {}
        for ids, logits in steps:
            for rid, row in zip(ids, logits, strict=True):
                rows.setdefault(rid, []).append(row.float().cpu())
        result = []
        for out, f in zip(outs, forced, strict=True):
            assert out.outputs[0].token_ids[:len(f)] == list(f), "teacher forcing did not take"
            ours = torch.stack(rows[out.request_id])
            assert ours.shape[0] == len(f) + 1, f"{ours.shape[0]} logits rows for {len(f) + 1} tokens"
            result.append(ours)
        return result
    finally:
        llm.shutdown()


# ------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module", params=sorted(TINY))
def ref(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_ref(REFS / request.param, "scripts/make_gpu_refs.py")


def load_ref(folder: Path, script: str) -> dict[str, Any]:
    """The fp32 CPU references saved in ``folder/ref.pt`` by ``script``, with the model folder and the
    teacher-forced continuations (``CONT_LEN`` tokens) added."""
    if not (folder / "ref.pt").is_file():
        pytest.fail(f"{folder}/ref.pt is missing: run {script}")
    data = torch.load(folder / "ref.pt", weights_only=True)
    data["folder"] = folder
    data.setdefault("name", folder.name)
    data["forced"] = [c[:CONT_LEN] for c in data["continuations"]]
    assert data["cont_len"] == CONT_LEN
    return data


def _compare(ref: dict[str, Any], ours: list[torch.Tensor], rel_tol: float, rms_tol: float,
             what: str) -> list[tuple[float, float]]:
    """Assert each prompt's logits within ``rel_tol`` x max|ref| (max) and ``rms_tol`` x rms(ref) (RMS),
    and the argmax equal at clear-margin rows; returns and prints (``-s``) the measured (max, RMS)."""
    errs = []
    for k, (o, r) in enumerate(zip(ours, ref["logits"], strict=True)):
        assert o.shape == r.shape
        scale = r.abs().max().item()
        rel = (o - r).abs().max().item() / scale
        rms = ((o - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item()
        errs.append((rel, rms))
        assert rel <= rel_tol, (f"{ref['name']} {what} prompt {k} (len {len(ref['prompts'][k])}): "
                                f"max|Δ| = {rel:.4f} × max|ref| > {rel_tol}")
        assert rms <= rms_tol, (f"{ref['name']} {what} prompt {k} (len {len(ref['prompts'][k])}): "
                                f"rms(Δ) = {rms:.4f} × rms(ref) > {rms_tol}")
        top2 = r.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * rel_tol * scale
        mismatched = (o.argmax(-1) != r.argmax(-1)) & clear
        assert not mismatched.any(), (f"{ref['name']} {what} prompt {k}: greedy token differs at clear-margin "
                                      f"rows {mismatched.nonzero().flatten().tolist()}")
    print(f"\nMEASURED {ref['name']:22s} {what:25s} max|Δ|/max|ref|, rms(Δ)/rms(ref) per prompt: "
          + "  ".join(f"{a:.2e},{b:.2e}" for a, b in errs))
    return errs


# ----------------------------------------------------------------------------------------------- tests

def test_bf16_teacher_forced_logits_one_request_at_a_time(ref: dict[str, Any]) -> None:
    """Each prompt alone: one prefill step, then CONT_LEN single-row decode steps."""
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE,
                                 one_call=False)
    _compare(ref, ours, BF16_REL_TOL, BF16_RMS_TOL, "bf16 single")


def test_bf16_teacher_forced_logits_batched(ref: dict[str, Any]) -> None:
    """All prompts in one generate call: a mixed-length prefill batch, then batched decode rows."""
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE)
    _compare(ref, ours, BF16_REL_TOL, BF16_RMS_TOL, "bf16 batched")


def test_bf16_teacher_forced_logits_chunked_prefill(ref: dict[str, Any]) -> None:
    """A 24-token step budget with 16-token blocks: prompts are prefilled in chunks that start and end
    inside blocks, mixed with other requests' decode rows."""
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="bfloat16", device=DEVICE,
                                 max_num_batched_tokens=24)
    _compare(ref, ours, BF16_REL_TOL, BF16_RMS_TOL, "bf16 chunked (budget 24)")


def test_fp32_on_device_teacher_forced_logits(ref: dict[str, Any]) -> None:
    """fp32 on the device, batched: must match the fp32 reference tightly (no bf16 noise to hide in)."""
    ours = teacher_forced_logits(ref["folder"], ref["prompts"], ref["forced"], dtype="float32", device=DEVICE)
    _compare(ref, ours, FP32_REL_TOL, FP32_REL_TOL, "fp32 batched")


def test_bf16_free_greedy_tokens_match_reference(ref: dict[str, Any]) -> None:
    """No forcing, all prompts batched: the engine's greedy tokens equal the fp32 greedy continuation
    at every row whose reference margin is clear; at the first near-tie where they differ the two
    sequences may legitimately part, so the comparison of that prompt ends there."""
    check_free_greedy(ref, BF16_REL_TOL)


def check_free_greedy(ref: dict[str, Any], rel_tol: float, **llm_args: Any) -> list[int]:
    """Greedy tokens of a free bf16 run against the reference continuation, compared at rows whose
    reference top-2 margin exceeds ``2 * rel_tol * max|ref|``, until the first near-tie where they part.
    Returns the number of tokens compared per prompt; ``llm_args`` go to ``LLM``."""
    llm = LLM(ref["folder"], dtype="bfloat16", device=DEVICE, kv_cache_bytes=KV_BYTES, block_size=BLOCK_SIZE,
              **llm_args)
    try:
        outs = llm.generate(ref["prompts"], SamplingParams(temperature=0, max_tokens=CONT_LEN + 1, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    compared = []
    for k, (out, cont, r) in enumerate(zip(outs, ref["continuations"], ref["logits"], strict=True)):
        got = out.outputs[0].token_ids
        assert len(got) == CONT_LEN + 1
        tol = 2 * rel_tol * r.abs().max().item()
        top2 = r.topk(2, dim=-1).values
        n = 0
        for j, (a, b) in enumerate(zip(got, cont, strict=True)):
            if (top2[j, 0] - top2[j, 1]).item() > tol:
                assert a == b, f"{ref['name']} prompt {k}: token {j} is {a}, reference {b} (clear margin)"
            elif a != b:
                break
            n += 1
        compared.append(n)
    print(f"\nMEASURED {ref['name']:22s} free greedy: tokens compared per prompt {compared} of {CONT_LEN + 1}")
    return compared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_the_device_is_the_float64_definition(dtype: torch.dtype) -> None:
    """``RMSNorm`` on CUDA takes torch's fused kernel: ``x / rms(x)`` in float32, cast back, times the weight, as
    the float64 statement of it up to the rounding of the dtype."""
    from deepinfer.model.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    norm = RMSNorm(576, 1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
    got = norm.to(DEVICE)(x.to(DEVICE)).float().cpu()
    x64 = x.double()
    normed = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    want = (norm.weight.detach().cpu().double() * normed.double()).to(dtype).float()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # a float32 rounding apart, or one bf16 ulp
    torch.testing.assert_close(got, want, rtol=tol, atol=1e-6)
