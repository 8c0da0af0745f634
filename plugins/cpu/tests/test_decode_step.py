"""The fused decode step (``decode_step.py``, ``csrc/decode_step.c``): a batch-1 decode step of a Llama-family
model runs the whole decoder stack in one C call. Its logits equal transformers' at every cached decode step
(plain, tied with llama3 rope, Qwen2's q/k/v biases, Qwen3's per-head q/k norms); it equals the model's layers
within float32 rounding (tokens, logprobs, the layer inputs a drafter captures, the cache it leaves for steps of several
rows), within bf16 rounding in a bf16 model, follows parameters re-bound to new storage or written in place,
and declines what it does not serve (steps of several rows, another attention backend, the switch off)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepinfer_cpu.cbuild import compiler
from spec_setup import spec_plugins, write_oracle_file
from tiny_models import assert_cached_logits_match, save_tiny

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.skipif(compiler() is None, reason="no C compiler"),
              pytest.mark.usefixtures("one_torch_thread")]

ENGINE = {"block_size": 16, "kv_cache_bytes": 1 << 22}


def _llm(folder: Path, fused: bool = True, plugins: dict | None = None, **kw) -> LLM:
    return LLM(folder, **ENGINE, **{"max_num_seqs": 1, **kw},
               plugins={"cpu": {"enabled": True, "fused_decode": fused}, **(plugins or {})})


def _fused_steps(llm: LLM, counter: str = "steps") -> int:
    """Steps the fused stack served through its kernels (``long_steps``: through the backend's linear)."""
    fused = getattr(llm.engine.runner.backends["linear"], "decode_stack", None)
    return 0 if fused is None else getattr(fused, counter)


def _prompts(seed: int, lengths: tuple[int, ...] = (3, 17, 33)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 200, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["llama", "llama-tied-llama3rope", "qwen2", "qwen3"])
def test_every_decode_step_matches_transformers(name: str, tmp_path: Path) -> None:
    """One request at a time: every decode step is fused (counted; the 3-token prompt too: fewer rows than
    ``min_rows``), and each step's logits are within 1e-4 of transformers on the whole sequence; prompts cross
    block boundaries (16-token blocks)."""
    model, folder = save_tiny(name, tmp_path)
    llm = _llm(folder)
    prompts = _prompts(1)
    assert_cached_logits_match(llm, model, prompts, decode_steps=20)
    assert _fused_steps(llm) == 20 * len(prompts) + 1
    llm.shutdown()


def _run(llm: LLM, prompts: list[list[int]], tokens: int = 14) -> list:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_same(fused: list, layers: list, tolerance: float) -> None:
    for a, b in zip(fused, layers, strict=True):
        assert a.token_ids == b.token_ids
        for tok, la, lb in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
            assert abs(la[tok] - lb[tok]) <= tolerance


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))[1]


def test_mixed_steps_and_speculation_equal_the_layers(tiny_llama: Path) -> None:
    """Two sequence slots over five prompts (decode steps and short prompts through the kernels, prompt chunks
    of ``min_rows`` rows or more through the backend's linear, in one request's life: each reads the cache the
    other wrote), then ``ngram``
    speculation (verification steps too): tokens equal the layers', logprobs within float32 rounding."""
    prompts = _prompts(2, (5, 40, 9, 23, 2))
    ngram = {"spec_decode": {"enabled": True, "drafter": "ngram", "max_draft": 3}}
    for extra in ({}, ngram):
        runs, fused_steps = {}, 0
        for fused in (True, False):
            llm = _llm(tiny_llama, fused, max_num_seqs=2, plugins=extra)
            runs[fused] = _run(llm, prompts)
            fused_steps += _fused_steps(llm)
            llm.shutdown()
        assert fused_steps > 0
        _assert_same(runs[True], runs[False], 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_verification_steps_equal_plain_decoding_bit_for_bit(tiny_llama: Path, dtype: str,
                                                                 tmp_path: Path) -> None:
    """At batch 1 every decode and verification step is fused (fewer rows than ``min_rows``), and the GEMV
    and attention sum each row as if alone: speculation (the ``oracle`` drafter on the known continuations,
    30% of drafts corrupted, so drafts are accepted and rejected) gives exactly plain decoding's tokens and
    logprobs."""
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no AVX512-BF16-class CPU")
    prompts = _prompts(12, (5, 14))
    plain_llm = _llm(tiny_llama, dtype=dtype)
    plain = _run(plain_llm, prompts, tokens=24)
    plain_llm.shutdown()
    oracle = write_oracle_file(tmp_path, prompts, [o.token_ids for o in plain])
    llm = _llm(tiny_llama, dtype=dtype, plugins=spec_plugins("oracle", "fixed", oracle_file=oracle,
                                                             oracle_corruption=0.3))
    spec = _run(llm, prompts, tokens=24)
    stats = llm.get_stats()["spec_decode"]
    assert stats["verify_steps"] > 0 and 1.5 < stats["mean_acceptance_length"] < 5.0  # accepted and rejected
    assert _fused_steps(llm) >= stats["verify_steps"]  # every step fused: decode, verification, the prompts
    llm.shutdown()
    _assert_same(spec, plain, 0.0)


def test_the_overlapped_executor_gives_the_same_tokens(tiny_llama: Path) -> None:
    """The fused step on the overlapped executor's worker thread (plugins.scheduling): the tokens and
    logprobs of the synchronous run, every decode step fused."""
    runs = {}
    for executor in ("sync", "overlap"):
        llm = _llm(tiny_llama, scheduler={"executor": executor},
                   plugins={"scheduling": {"enabled": executor == "overlap"}})
        runs[executor] = _run(llm, _prompts(11, (14, 30)))  # prompts of min_rows (13) rows or more: long steps
        assert _fused_steps(llm) == 2 * 13
        llm.shutdown()
    _assert_same(runs["overlap"], runs["sync"], 0.0)


def test_captured_layer_inputs_equal_the_layers(tiny_llama: Path) -> None:
    """The layer inputs a drafter reads (``capture_hidden``: the first layer's, the second's, the last
    output) at every fused step equal the layers' within float32 rounding."""
    captured = {}
    for fused in (True, False):
        llm = _llm(tiny_llama, fused)
        model = llm.engine.model
        model.capture_hidden([0, 1, 2])
        forward, seen = model.forward, []

        def keep(input_ids, ctx, forward=forward, seen=seen, model=model):
            out = forward(input_ids, ctx)
            if input_ids.shape[0] == 1:
                seen.append({i: t.clone() for i, t in model.captured_hidden.items()})
            return out
        model.forward = keep
        _run(llm, _prompts(3, (15,)), tokens=10)  # the prompt: more rows than the fused step takes
        captured[fused] = seen
        assert _fused_steps(llm) == (9 if fused else 0)
        llm.shutdown()
    assert len(captured[True]) == len(captured[False]) == 9
    for a, b in zip(captured[True], captured[False], strict=True):
        assert sorted(a) == sorted(b) == [0, 1, 2]
        for i in a:
            torch.testing.assert_close(a[i], b[i], rtol=1e-5, atol=1e-5)


def test_parameters_rebound_or_written_in_place_are_followed(tiny_llama: Path) -> None:
    """After a first request, one layer's ``o_proj`` is re-bound to new storage (scaled) and a norm weight is
    scaled in place: the fused step's next tokens and logprobs equal the layers' on the same changed model."""
    runs = {}
    for fused in (True, False):
        llm = _llm(tiny_llama, fused)
        _run(llm, _prompts(4, (6,)))
        layer = llm.engine.model.layers[1]
        with torch.no_grad():
            layer.self_attn.o_weight.data = layer.self_attn.o_weight.data * 1.7
            layer.input_layernorm.weight.mul_(0.6)
        runs[fused] = _run(llm, _prompts(5, (11, 4)))
        llm.shutdown()
    _assert_same(runs[True], runs[False], 1e-5)


@pytest.mark.parametrize(("quantization", "inputs"), [("q4_1", "int8"), ("q4_1", "float32"), ("int8", "int8")])
def test_quantized_weights_take_their_kernels_in_the_fused_step(tiny_llama: Path, quantization: str,
                                                                inputs: str) -> None:
    """Under ``model.quantization`` each projection of the fused step runs the quantized backend's own kernel
    (with its input rounding), on every step of fewer than ``quant_dense_rows`` rows (short prompts too), so
    tokens equal the layers' and logprobs agree within float32 rounding; a weight written in place is
    re-quantized for the fused step as for the layers."""
    runs = {}
    for fused in (True, False):
        llm = _llm(tiny_llama, fused, quantization=quantization,
                   plugins={"cpu": {"enabled": True, "fused_decode": fused, "quant_inputs": inputs}})
        assert llm.engine.runner.backends["linear"].name == f"cpu_{quantization}"
        first = _run(llm, _prompts(9, (6, 21)))
        with torch.no_grad():
            llm.engine.model.layers[0].mlp.down_weight.mul_(-1.0)
        runs[fused] = first + _run(llm, _prompts(10, (5,)))
        # 13 decode steps per request, and the prompts of 6 and 5 tokens (fewer rows than quant_dense_rows)
        assert _fused_steps(llm) == (3 * 13 + 2 if fused else 0)
        llm.shutdown()
    _assert_same(runs[True], runs[False], 1e-5)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no AVX512-BF16-class CPU")
def test_bfloat16_steps_equal_the_layers_within_bf16_rounding(tiny_llama: Path) -> None:
    """A bf16 model: the kernel rounds where the torch layers round, so tokens equal and logprobs differ by at
    most a few bf16 steps of the logits (summation order)."""
    runs = {}
    for fused in (True, False):
        llm = _llm(tiny_llama, fused, dtype="bfloat16")
        runs[fused] = _run(llm, _prompts(6, (4, 19)))
        assert _fused_steps(llm) == (2 * 13 + 1 if fused else 0)  # decode steps and the 4-token prompt
        llm.shutdown()
    _assert_same(runs[True], runs[False], 0.1)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_long_steps_match_transformers(name: str, tmp_path: Path) -> None:
    """Prompts of 17, 40 and 70 tokens (more rows than the kernels take, chunks longer than ``cpu_paged``'s): the
    projections through the backend's linear, attention through the attention backend, the loops between them in
    C, on every thread from 64 rows (the 70-token prompt): prefill and decode logits within 1e-4 of
    transformers (Qwen2's biases through linear, Qwen3's per-head norms in C)."""
    model, folder = save_tiny(name, tmp_path)
    llm = _llm(folder)
    assert_cached_logits_match(llm, model, _prompts(5, (17, 40, 70)), decode_steps=3)
    assert (_fused_steps(llm, "long_steps"), _fused_steps(llm)) == (3, 3 * 3)
    llm.shutdown()


def test_long_steps_equal_the_layers_on_two_threads(tiny_llama: Path) -> None:
    """Two sequence slots, prompts of 70 and 90 tokens (one step of 160 rows, its loops on both threads), decode
    steps of two requests through linear (``min_rows`` 2) with ``cpu_paged``'s kernel attending: tokens equal the
    layers', logprobs within float32 rounding."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = {}
        for fused in (True, False):
            llm = _llm(tiny_llama, fused, max_num_seqs=2, plugins={"cpu": {"enabled": True, "fused_decode": fused,
                                                                           "min_rows": 2}})
            runs[fused] = _run(llm, _prompts(9, (70, 90)), tokens=6)
            assert _fused_steps(llm, "long_steps") == (6 if fused else 0)
            llm.shutdown()
    finally:
        torch.set_num_threads(before)
    _assert_same(runs[True], runs[False], 1e-5)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no AVX512-BF16-class CPU")
def test_bfloat16_long_steps_equal_the_layers_within_bf16_rounding(tiny_llama: Path) -> None:
    """A bf16 model's long steps (prompts of 20 and 70 tokens): the C loops read and write the projections'
    bf16 rows where they lie and round where the torch layers round."""
    runs = {}
    for fused in (True, False):
        llm = _llm(tiny_llama, fused, dtype="bfloat16")
        runs[fused] = _run(llm, _prompts(10, (20, 70)))
        assert _fused_steps(llm, "long_steps") == (2 if fused else 0)
        llm.shutdown()
    _assert_same(runs[True], runs[False], 0.1)


def test_a_failing_projection_raises_from_the_step(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception inside the backend's linear, called back from the C loop, is raised again by the step once
    the kernel has returned (it cannot cross the C frames)."""
    llm = _llm(tiny_llama)
    backend = llm.engine.runner.backends["linear"]

    def failing(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("linear failed")

    monkeypatch.setattr(backend.decode_stack, "linear", failing)
    with pytest.raises(RuntimeError, match="linear failed"):
        _run(llm, _prompts(3, (40,)), tokens=2)
    llm.shutdown()


def test_what_it_does_not_serve_runs_the_layers(tiny_llama: Path) -> None:
    """The core's attention backend, and the switch off: no step is fused."""
    for llm in (_llm(tiny_llama, kernels={"attention": "torch"}), _llm(tiny_llama, fused=False)):
        _run(llm, _prompts(8, (5,)), tokens=4)
        assert _fused_steps(llm) == _fused_steps(llm, "long_steps") == 0
        llm.shutdown()
