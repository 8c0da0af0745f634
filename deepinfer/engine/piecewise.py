"""CUDA graphs for steps with prompt rows: the forward captured in pieces, cut at its attention calls.

A step that brings prompt rows (or query rows longer than the decode graphs' bound, ``engine/graphs.py``)
cannot replay a decode graph: its attention backend plans the prefill work from the step's host lists.
Everything else in the forward (embedding, norms, projections, rope, MLP or MoE) reads device tensors only,
of a fixed shape once the step is padded to a bucket of ``Tb`` tokens. So per bucket the forward is captured
as ``L + 1`` graphs, cut at each attention call (an op of ``CUT_OPS``); a replay of ``T ≤ Tb`` tokens runs
graph 0, then layer 0's attention eagerly on the step's own ``ForwardContext`` over the first ``T`` rows of
the query/key/value tensors graph 0 left, copies its output into the static tensor graph 1 reads, runs graph
1, and so on. The host launches ``L + 1`` graphs and ``L`` attention calls where an eager step launches ~35
kernels per layer (a SmolLM2 step with prompt rows: ~1,100 launches, host-bound at 20–30 ms on an H100
against ~5 ms of device work). vLLM's piecewise CUDA graphs cut the forward the same way.

Padding: the ``Tb − T`` extra rows keep the token ids and positions of earlier steps (valid ids and
positions, so every kernel reads in bounds); no attention is computed for them (their rows of each attention
output keep stale values) and they meet real rows in no kernel, every non-attention op being row-wise; the
MoE layers' router statistics count only the first ``num_real_tokens`` rows (set to ``T``).

Served: models without per-request state (V4's rings and compressors are updated outside the attention
calls, from host lists), whose every op but the cut ones has a ``graph_safe`` backend, with the layer features
kept in ``captured_hidden`` that the graphs captured (``keeps``), and no Inductor-compiled layers.
``emulate`` (CPU tests) captures nothing and runs the forward on the static buffers with the cuts in place:
the same padding, slicing and copies as a replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from deepinfer.engine.context import SpanLayout, forward_context
from deepinfer.interfaces import ForwardContext
from deepinfer.model.base import CausalLM

logger = logging.getLogger(__name__)

# The attention ops the forward is cut at, each with its method and the positions of its token-major
# tensor arguments (``[T, ...]``; a replay passes their first ``T`` rows). Their outputs are ``[T, ...]``.
CUT_OPS: dict[str, tuple[str, tuple[int, ...]]] = {
    "paged_attention": ("paged_attention", (0, 1, 2)),  # q, k, v, kv_cache, ctx
    "mla_attention": ("mla_attention", (0, 1, 2, 3)),  # q_nope, q_pe, latent, k_pe, cache, ctx
}


def piecewise_buckets(largest: int, smallest: int = 8) -> list[int]:
    """Powers of two from ``smallest`` to 512, then every 256 tokens, up to and including ``largest``."""
    buckets, b = [], smallest
    while b < min(largest, 512):
        buckets.append(b)
        b *= 2
    b = 512 if largest > 512 else b
    while b < largest:
        buckets.append(b)
        b += 256
    return sorted({*buckets, largest})


@dataclass
class _Cut:
    """One attention call of a captured forward: the method, its arguments as the capture passed them
    (the token-major ones static tensors of ``Tb`` rows) and the static output the next piece reads."""

    method: Callable[..., torch.Tensor]
    token_args: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]
    out: torch.Tensor | None = None  # set by the capture


@dataclass
class _Bucket:
    """One bucket's static inputs, its pieces (graph ``i`` runs before cut ``i``; the last graph has no cut
    after it) and static outputs."""

    tokens: int
    input_ids: torch.Tensor
    ctx: ForwardContext  # the capture's: its positions and num_real_tokens are static inputs
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    cuts: list[_Cut] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    captured: dict[int, torch.Tensor] = field(default_factory=dict)


class _Cutter:
    """Stands in for an attention backend in the capture's ``backends``: each call of its op ends the piece
    being captured, runs the real call eagerly (for an output tensor to keep), then starts the next piece.
    Under ``emulate`` it runs the call as a replay would. Other attributes are the backend's."""

    def __init__(self, owner: PiecewiseGraphs, backend: Any, method: str, token_args: tuple[int, ...]) -> None:
        self._owner, self._backend, self._method, self._token_args = owner, backend, method, token_args

    def __getattr__(self, name: str) -> Any:
        if name != self._method:
            return getattr(self._backend, name)
        return self._call

    def _call(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._owner.cut(_Cut(getattr(self._backend, self._method), self._token_args, args, kwargs))


class PiecewiseGraphs:
    """Captures the forward in pieces per bucket of tokens and replays it for any step that fits a bucket."""

    def __init__(self, model: CausalLM, backends: Mapping[str, Any], block_size: int, device: torch.device,
                 max_tokens: int, emulate: bool = False) -> None:
        self.model = model
        self.backends = backends
        self.block_size = block_size
        self.device = device
        self.emulate = emulate
        self.buckets = piecewise_buckets(max_tokens)
        self.captured_layers = tuple(getattr(model, "captured_layers", ()))
        self.cut_ops = {op: CUT_OPS[op] for op in CUT_OPS if op in backends}
        self._buckets: dict[int, _Bucket] = {}
        self._mode = ""  # what a cut does: "warm-up", "capture", "emulate" (an emulated replay)
        self._capturing: _Bucket | None = None
        self._emulated: tuple[ForwardContext, int] | None = None  # an emulated replay's step context and T
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self.replays = 0

    def _capture_context(self, tokens: int) -> ForwardContext:
        """One-token requests at position 0 on the scratch block 0 (as ``DecodeGraphs``' capture), whose
        backends cut at the attention ops; positions and the real-token count are the static inputs."""
        ctx = forward_context(SpanLayout.of([((0,), 0, 1)] * tokens, self.block_size), block_size=self.block_size,
                              backends=self.backends, device=self.device)
        cutters = {op: _Cutter(self, self.backends[op], method, token_args)
                   for op, (method, token_args) in self.cut_ops.items()}
        return replace(ctx, backends={**self.backends, **cutters},
                       num_real_tokens=torch.zeros((), dtype=torch.int64, device=self.device))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, all pieces in one memory pool."""
        if not self.emulate:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        for tokens in reversed(self.buckets):
            bucket = _Bucket(tokens, torch.zeros(tokens, dtype=torch.int64, device=self.device),
                             self._capture_context(tokens))
            self._buckets[tokens] = bucket
            if self.emulate:
                continue
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._mode = "warm-up"  # kernel compilation, autotuning, library handles
                self.model.forward(bucket.input_ids, bucket.ctx)
                torch.cuda.synchronize(self.device)
                self._mode, self._capturing = "capture", bucket
                self._begin_piece()
                bucket.hidden = self.model.forward(bucket.input_ids, bucket.ctx)
                bucket.graphs[-1].capture_end()
                self._mode, self._capturing = "", None
            bucket.captured = {i: self.model.captured_hidden[i] for i in self.captured_layers}
        if not self.emulate:
            torch.cuda.synchronize(self.device)
        logger.info("captured piecewise CUDA graphs for buckets %s", self.buckets)

    def _begin_piece(self) -> None:
        assert self._capturing is not None
        graph = torch.cuda.CUDAGraph()
        self._capturing.graphs.append(graph)
        graph.capture_begin(pool=self._pool)

    def cut(self, call: _Cut) -> torch.Tensor:
        """An attention call reached while the forward runs on a bucket's capture context (``_Cutter``)."""
        if self._mode == "capture":
            bucket = self._capturing
            assert bucket is not None
            bucket.graphs[-1].capture_end()
            call.out = call.method(*call.args, **call.kwargs)  # eager, between two pieces: the static output
            bucket.cuts.append(call)
            self._begin_piece()
            return call.out
        if self._mode == "emulate":
            assert self._emulated is not None
            ctx, num_tokens = self._emulated
            rows = call.args[call.token_args[0]].shape[0]
            answer = call.method(*_step_args(call, ctx, num_tokens), **call.kwargs)
            out = answer.new_zeros(rows, *answer.shape[1:])
            out[:num_tokens] = answer
            return out
        assert self._mode == "warm-up", "an attention cut outside a capture, a warm-up or an emulated replay"
        return call.method(*call.args, **call.kwargs)

    def keeps(self, layers: tuple[int, ...]) -> bool:
        """Whether a replay leaves the features of ``layers`` in the model's ``captured_hidden``."""
        return set(layers) <= set(self.captured_layers)

    def serves(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` query tokens fits a bucket."""
        return num_tokens <= self.buckets[-1]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The model's forward of a step (``input_ids [T]``, its own context) through the smallest bucket
        of at least ``T`` tokens; returns ``[T, H]`` and leaves the kept layer features' first ``T`` rows in
        the model's ``captured_hidden``, as an eager forward does."""
        num_tokens = input_ids.shape[0]
        bucket = self._buckets[next(b for b in self.buckets if b >= num_tokens)]
        bucket.input_ids[:num_tokens].copy_(input_ids)
        bucket.ctx.positions[:num_tokens].copy_(ctx.positions)
        assert bucket.ctx.num_real_tokens is not None
        bucket.ctx.num_real_tokens.fill_(num_tokens)
        self.replays += 1
        if self.emulate:
            self._mode, self._emulated = "emulate", (ctx, num_tokens)
            try:
                hidden = self.model.forward(bucket.input_ids, bucket.ctx)
            finally:
                self._mode, self._emulated = "", None
        else:
            assert bucket.hidden is not None
            for graph, cut in zip(bucket.graphs, [*bucket.cuts, None], strict=True):
                graph.replay()
                if cut is not None:
                    assert cut.out is not None
                    cut.out[:num_tokens].copy_(cut.method(*_step_args(cut, ctx, num_tokens), **cut.kwargs))
            hidden = bucket.hidden
            if bucket.captured:
                self.model.captured_hidden.update(bucket.captured)
        for i in self.captured_layers:
            self.model.captured_hidden[i] = self.model.captured_hidden[i][:num_tokens]
        return hidden[:num_tokens]


def _step_args(call: _Cut, ctx: ForwardContext, num_tokens: int) -> list:
    """A cut call's arguments for a step: its context for the capture's, the first ``num_tokens`` rows of the
    token-major tensors."""
    return [ctx if isinstance(a, ForwardContext) else a[:num_tokens] if i in call.token_args else a
            for i, a in enumerate(call.args)]
