"""``kernels.compile: inductor`` on CPU (Inductor's C++ backend; the GPU side is ``test_gpu_compile.py``):
compiled layers give the plain layers' greedy tokens and logprobs, one compiled graph serves every layer,
plugin backends are not traced, and the switch refuses what it cannot serve."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.engine.compiled import OpaqueBackend
from deepinfer.errors import ConfigError

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 40))]


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [d[t] for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                            strict=True)]) for o in outs]


def _llm(folder: Path, mode: str, **kernels: object) -> LLM:
    return LLM(folder, device="cpu", dtype="float32", kv_cache_bytes=1 << 24, block_size=16,
               kernels={"compile": mode, **kernels})


@pytest.mark.slow
def test_compiled_layers_equal_plain_layers_and_share_one_compile(tmp_path: Path) -> None:
    import torch._dynamo.utils as dynamo_utils

    save_tiny("llama", tmp_path, num_hidden_layers=4)
    plain_llm = _llm(tmp_path, "off")
    plain = _run(plain_llm)
    plain_llm.shutdown()
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    llm = _llm(tmp_path, "inductor")
    assert isinstance(llm.engine.runner.backends["paged_attention"], OpaqueBackend)
    compiled = _run(llm)
    for (ids_p, lp_p), (ids_c, lp_c) in zip(plain, compiled, strict=True):
        assert ids_p == ids_c
        assert torch.allclose(torch.tensor(lp_p), torch.tensor(lp_c), atol=1e-4, rtol=0)
    # Two pieces per layer (before and after the attention call), each compiled for one-token and
    # many-token steps: the count does not grow with the four layers.
    assert 0 < dynamo_utils.counters["stats"]["unique_graphs"] <= 8
    llm.shutdown()


def test_compile_refuses_batch_invariant_kernels(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path)
    with pytest.raises(ConfigError, match=r"cannot be combined with kernels\.batch_invariant"):
        _llm(tmp_path, "inductor", batch_invariant=True)


def test_compile_mode_is_validated(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path)
    with pytest.raises(ConfigError, match=r"kernels\.compile"):
        _llm(tmp_path, "triton")


def test_compile_switch_reads_yaml_booleans() -> None:
    from deepinfer.config import KernelsSection

    assert KernelsSection(compile=False).compile == "off"
    assert KernelsSection(compile=True).compile == "inductor"


@pytest.mark.slow
def test_compiled_deepseek_v3_gives_the_plain_tokens_and_routed_token_counts(tmp_path: Path) -> None:
    """The MoE layers count each expert's rows (``router_stats``, read by the load balancer) with a one-hot
    sum when compiled: the counts equal the plain layers' ``index_add_``."""
    from tiny_deepseek import save_tiny_v3

    save_tiny_v3(tmp_path)
    results = []
    for mode in ("off", "inductor"):
        llm = _llm(tmp_path, mode)
        results.append((_run(llm), llm.engine.model.router_stats.clone()))
        llm.shutdown()
    (plain, plain_counts), (compiled, compiled_counts) = results
    assert [ids for ids, _ in plain] == [ids for ids, _ in compiled]
    assert plain_counts.sum() > 0 and torch.equal(plain_counts, compiled_counts)


def _assert_compiled_v4_family_equals_plain(make: Callable[..., LLM]) -> None:
    """Greedy tokens and logprobs of ``make(kernels=…, max_num_batched_tokens=32)`` with compiled layers equal
    the plain layers' (prompts whose windows close in prefill chunks and in decode steps)."""
    from test_deepseek_v4 import prompts

    batch = prompts([5, 23, 40, 9], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    results = []
    for mode in ("off", "inductor"):
        llm = make(kernels={"compile": mode}, max_num_batched_tokens=32)
        outs = [o.outputs[0] for o in llm.generate(batch, sp, use_tqdm=False)]
        results.append([(o.token_ids, [d[t] for t, d in zip(o.token_ids, o.logprobs, strict=True)]) for o in outs])
        llm.shutdown()
    for (ids_p, lp_p), (ids_c, lp_c) in zip(*results, strict=True):
        assert ids_p == ids_c
        assert torch.allclose(torch.tensor(lp_p), torch.tensor(lp_c), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_deepseek_v4_gives_the_plain_tokens_and_logprobs(tmp_path: Path) -> None:
    """DeepSeek-V4's compiled layers write the compressors' rings and entries in place (``write_rows``) and
    run the cell-wise Sinkhorn (``sinkhorn_cells``): the plain layers' greedy tokens and logprobs, with
    windows closing in prefill chunks and in decode steps."""
    from test_deepseek_v4 import build, make_llm

    build("v4-yarn", tmp_path)
    _assert_compiled_v4_family_equals_plain(lambda **kw: make_llm(tmp_path, **kw))


@pytest.mark.slow
def test_compiled_deepseek_v41_gives_the_plain_tokens_and_logprobs(tmp_path: Path) -> None:
    """DeepSeek-V4.1's compiled layers (shifted hyper-connections, cross-layer sharing, candidate blocks,
    the index ranking between its backend calls): the plain layers' greedy tokens and logprobs."""
    from test_deepseek_v41 import build_v41, v41_llm

    build_v41(tmp_path)
    _assert_compiled_v4_family_equals_plain(lambda **kw: v41_llm(tmp_path, **kw))
