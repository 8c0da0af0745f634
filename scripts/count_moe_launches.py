"""Count the kernels one DeepSeek MoE layer launches (router + routed experts + shared experts) at a
given token count, with the ``triton`` MoE backend's fused router and sort-free layout on and off.

    python scripts/count_moe_launches.py [--tokens 16] [--compile] [--experts 64] [--top-k 6] [--balanced]

The layer is ``scripts/bench_gpu_deepseek.py``'s V2-Lite shape (hidden 2048, 64 experts top-6, width
1408, two shared experts, sigmoid/noaux_tc with n_group 1) built on its own with random weights; the
count is the CUDA kernels ``torch.profiler`` records for one forward after warm-up. On CPU (run with
``TRITON_INTERPRET=1`` and a small ``--hidden``/``--inter``) it is the aten ops that would launch a kernel
(views and allocations left out) plus the Triton launches, counted at the interpreter's grid call.
``--compile`` compiles the layer as ``kernels.compile: inductor`` does (backend ops
are graph breaks through ``engine/compiled.OpaqueBackend``). Needs ``plugins/moe`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import collections

import torch
from deepinfer_moe.triton_backend import TritonMoEBackend
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.interfaces import ForwardContext
from deepinfer.model.deepseek_v3 import FORCE_BALANCED_ROUTING_KEY, DeepseekMoE, _Dims
from deepinfer.model.layers.reference import TorchGemmBackend


def build_layer(args: argparse.Namespace, device: torch.device) -> DeepseekMoE:
    hf = {"hidden_size": args.hidden, "num_attention_heads": 16, "num_hidden_layers": 8, "vocab_size": 1000,
          "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
          "intermediate_size": 10944, "moe_intermediate_size": args.inter, "n_routed_experts": args.experts,
          "n_shared_experts": 2, "num_experts_per_tok": args.top_k, "n_group": args.n_group,
          "topk_group": args.topk_group, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
          "norm_topk_prob": True, FORCE_BALANCED_ROUTING_KEY: args.balanced}
    layer = DeepseekMoE(_Dims(hf, "DeepseekV3ForCausalLM"), 1, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.02)
    return layer


def count(layer: DeepseekMoE, tokens: int, backend: TritonMoEBackend, compile_layer: bool,
          device: torch.device) -> collections.Counter:
    backends = {"linear": TorchGemmBackend(), "experts": backend}
    if compile_layer:
        from deepinfer.engine.compiled import OpaqueBackend

        backends["experts"] = OpaqueBackend(backend)
    ctx = ForwardContext(positions=None, slot_mapping=None, query_start_loc=None, seq_lens=None,
                         block_tables=None, num_decodes=tokens, query_start_loc_host=[], seq_lens_host=[],
                         block_size=16, backends=backends)
    x = torch.randn(tokens, layer.d.hidden, dtype=torch.bfloat16, device=device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    run = torch.compile(layer, dynamic=True) if compile_layer else layer
    with torch.no_grad():
        for _ in range(3):
            run(x, positions, ctx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            run(x, positions, ctx)
            if device.type == "cuda":
                torch.cuda.synchronize()
    kernels: collections.Counter = collections.Counter()
    if device.type != "cuda":  # no device kernels to record: the aten ops that compute (not views)
        with torch.no_grad(), _AtenOps(kernels):
            run(x, positions, ctx)
        return kernels
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:90]] += 1
    return kernels


class _AtenOps(TorchDispatchMode):
    """Counts the aten ops that would launch a kernel on a GPU (skips views and allocations) and the
    Triton launches under ``TRITON_INTERPRET=1`` (not the aten ops the interpreter runs inside them)."""

    _FREE = ("view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute",
             "empty", "empty_like", "empty_strided", "detach", "alias", "split", "slice", "select", "as_strided",
             "unflatten", "lift_fresh", "_unsafe_view")

    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts
        self.in_triton = 0

    def __enter__(self) -> _AtenOps:
        from triton.runtime import interpreter  # the interpreter's own tensor shuffling is not counted

        self._launch = launch = interpreter.GridExecutor.__call__
        mode = self

        def counted(executor: object, *args: object, **kwargs: object) -> object:
            mode.counts[f"triton::{executor.fn.__name__}"] += 1
            mode.in_triton += 1
            try:
                return launch(executor, *args, **kwargs)
            finally:
                mode.in_triton -= 1

        interpreter.GridExecutor.__call__ = counted
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        from triton.runtime import interpreter

        interpreter.GridExecutor.__call__ = self._launch
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self._FREE and not self.in_triton:
            self.counts[f"aten::{name}"] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048, help="small values make CPU (interpreter) runs fast")
    parser.add_argument("--inter", type=int, default=1408)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--n-group", type=int, default=1)
    parser.add_argument("--topk-group", type=int, default=1)
    parser.add_argument("--balanced", action="store_true", help="kernels.force_balanced_routing (the benchmark)")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = build_layer(args, device)
    for tokens in args.tokens:
        for new in (False, True):
            backend = TritonMoEBackend(fused_router=new, sort_free_layout=new)
            kernels = count(layer, tokens, backend, args.compile, device)
            label = "new (fused router, sort-free layout)" if new else "old (torch router, torch sort layout)"
            print(f"T={tokens} {label}: {sum(kernels.values())} launches")
            for name, n in kernels.most_common():
                print(f"    {n:3d}  {name}")


if __name__ == "__main__":
    main()
