"""CUDA graphs for decode-shaped steps: forward and LM head captured once per bucket of query tokens.

A step is *decode-shaped* when every request in it brings at most ``max_query_len`` query tokens
(1, or 1 + max_draft under speculative decoding) and none asks for prompt logprobs. Such a step of
``T`` tokens replays the graph of the smallest bucket ``Tb ≥ T`` (buckets: 1, 2, 4, then every
``interval`` tokens up to the largest, as the reference system does). Sampling and verification run
eagerly after the replay: they are a handful of device kernels with no host sync.

Static inputs (token ids, positions, cache slots, sequence lengths, the number of real tokens, query
starts and block tables) are filled on the device from one packed pinned host buffer, in the runner's
``execute`` (the device's thread, in step order), never while a previous replay may still read them.
Padding: the ``Tb − T`` extra tokens are one-token requests at position 0 that write the reserved
scratch block 0; requests past those have no query tokens. ``ForwardContext.num_real_tokens`` holds
``T`` on the device, so that statistics (the MoE layers' ``router_stats``) skip the padding rows
without a host sync; it is 0 until the first step is loaded, so the capture's warm-up forward and the
start-up replays that profile the step cost count nothing. Backends used under graphs must be
``graph_safe``: with ``ctx.max_query_len`` at most their bound they must not read the context's host
lists, whose values are the capture's, not the step's (``interfaces.ForwardContext``).

Models with per-request state (``stateful``: DeepSeek-V4's rings and compressors, ``kv/state.py``): the
static context also carries each request's state slot (padding on the reserved slot 0), and the model
updates its state on device tensors only in decode and verification steps (V4:
``Compressor._update_rows``, for up to ``cache.max_backtrack + 1`` query tokens per request, which the
spec_decode plugin's ``max_backtrack ≥ max_draft + 1`` covers), so both replay graphs. Layer features
the model keeps in ``captured_hidden`` when the graphs are built (``captured_layers``: V4's final streams
for its MTP drafter, dspark's target layers — the engine builds the drafter first) are kept per graph and
handed back after each replay (``keeps``); features asked for later are not, and such steps run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from deepinfer.engine.context import SpanLayout, forward_context
from deepinfer.interfaces import ForwardContext
from deepinfer.model.base import CausalLM

logger = logging.getLogger(__name__)


def graph_buckets(largest: int, interval: int = 8) -> list[int]:
    """1, 2, 4, then every ``interval`` tokens, up to and including ``largest``."""
    buckets = [b for b in (1, 2, 4) if b < largest]
    b = interval
    while b < largest:
        buckets.append(b)
        b += interval
    return sorted({*buckets, largest})


def pack_step(tokens: int, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
              starts: list[int], tables: list[list[int]], state_slots: list[int] | None = None
              ) -> tuple[np.ndarray, int]:
    """A step's inputs padded to a bucket of ``tokens`` query tokens, as one int64 vector: ids,
    positions, slots and seq_lens (``tokens`` entries each), the number of real tokens (one entry), the
    query starts (``tokens + 1``), the requests' state slots (``tokens``; models with per-request state),
    then the ``[B, width]`` block tables. Returns it and ``width``. The padding tokens are one-token
    requests at position 0 writing slot 0 (the reserved scratch block) and state slot 0 (reserved too);
    requests after them have no query tokens."""
    n, b = len(ids), len(seq_lens)
    width = max(len(t) for t in tables)
    pad = tokens - n
    packed = np.zeros(6 * tokens + 2 + b * width, dtype=np.int64)
    packed[:n] = ids
    packed[tokens:tokens + n] = positions
    packed[2 * tokens:2 * tokens + n] = slots
    packed[3 * tokens:3 * tokens + b] = seq_lens
    packed[3 * tokens + b:3 * tokens + b + pad] = 1
    packed[4 * tokens] = n
    qsl = packed[4 * tokens + 1:5 * tokens + 2]
    qsl[:b + 1] = starts
    qsl[b + 1:b + 1 + pad] = np.arange(n + 1, tokens + 1)
    qsl[b + 1 + pad:] = tokens
    if state_slots is not None:
        packed[5 * tokens + 2:5 * tokens + 2 + b] = state_slots
    tables_out = packed[6 * tokens + 2:].reshape(b, width)
    for i, table in enumerate(tables):
        tables_out[i, :len(table)] = table
    return packed, width


@dataclass
class GraphStep:
    """A decode-shaped step staged for replay: ``staged`` is the packed int64 inputs already on the
    device (``pack_step``: ids, positions, slots, seq_lens padded to the bucket, the number of real
    tokens, query starts, state slots, then the ``[B, width]`` block tables)."""

    bucket: tuple[int, int]
    num_tokens: int
    num_requests: int
    width: int
    staged: torch.Tensor


class _Graph:
    """One captured bucket: its static inputs, outputs and the graph."""

    def __init__(self, tokens: int, max_query_len: int, block_tables: torch.Tensor, block_size: int,
                 backends: Mapping[str, object], stateful: bool) -> None:
        device = block_tables.device
        self.tokens = tokens
        t = tokens
        # The capture's batch: one-token requests at position 0 on the scratch block 0 (and, for models
        # with per-request state, the reserved state slot 0); its host lists stay the context's.
        idle = [0] * t if stateful else None
        capture = forward_context(SpanLayout.of([((0,), 0, 1)] * t, block_size), block_size=block_size,
                                  backends=backends, device=device, state_slots=idle, write_floors=idle)
        # Static inputs: ids | positions | slots | seq_lens | real tokens (0: nothing counted until a step
        # is loaded), then the query starts and state slots; ``load`` copies each step into them.
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        self.flat = torch.cat([zero.expand(t), capture.positions, capture.slot_mapping, capture.seq_lens, zero])
        self.query_start_loc = capture.query_start_loc
        self.state_slots = capture.state_slots if stateful else torch.zeros(t, dtype=torch.int64, device=device)
        self.input_ids = self.flat[:t]
        self.ctx = replace(capture, positions=self.flat[t:2 * t], slot_mapping=self.flat[2 * t:3 * t],
                           seq_lens=self.flat[3 * t:4 * t], block_tables=block_tables[:tokens],
                           num_decodes=t if max_query_len == 1 else 0, max_query_len=max_query_len,
                           num_real_tokens=self.flat[4 * t])
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        # The model's captured layer features of the capture (static, like ``hidden``): layer id → tensor.
        self.captured: dict[int, torch.Tensor] = {}


class DecodeGraphs:
    """Captures and replays the model's forward and LM head for decode-shaped steps."""

    def __init__(self, model: CausalLM, backends: Mapping[str, object], block_size: int, device: torch.device,
                 max_tokens: int, max_query_lens: tuple[int, ...], max_blocks: int, interval: int = 8,
                 emulate: bool = False, stateful: bool = False) -> None:
        """``emulate``: never capture; ``replay`` runs the forward eagerly on the static buffers. It runs
        the same padding and the backends' graph contract anywhere (CPU tests). ``stateful``: the model
        keeps per-request state slots (``kv/state.py``), which the static context then carries."""
        self.emulate = emulate
        self.stateful = stateful
        self.model = model
        # Layer features the model keeps now (``captured_hidden``): each graph keeps its own (``keeps``).
        self.captured_layers = tuple(getattr(model, "captured_layers", ()))
        self.backends = backends
        self.block_size = block_size
        self.device = device
        self.buckets = graph_buckets(max_tokens, interval)
        self.max_query_lens = tuple(sorted(set(max_query_lens)))
        self.block_tables = torch.zeros(max_tokens, max_blocks, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0
        self._placeholder_ids = torch.Generator().manual_seed(0)  # load_placeholder's token ids

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, query-length bound), largest first, in one memory pool."""
        pool = None if self.emulate else torch.cuda.graph_pool_handle()
        for qlen in self.max_query_lens:
            for tokens in reversed(self.buckets):
                graph = _Graph(tokens, qlen, self.block_tables, self.block_size, self.backends, self.stateful)
                self.graphs[(tokens, qlen)] = graph
                if self.emulate:
                    continue
                ctx = graph.ctx
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm-up: kernel compilation, autotuning, library handles
                    self.model.compute_logits(self.model.forward(graph.input_ids, ctx), ctx)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph.graph, pool=pool):
                    graph.hidden = self.model.forward(graph.input_ids, ctx)
                    graph.logits = self.model.compute_logits(graph.hidden, ctx)
                graph.captured = {i: self.model.captured_hidden[i] for i in self.captured_layers}
        if not self.emulate:
            torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (buckets %s, query-length bounds %s)", len(self.graphs),
                    self.buckets, self.max_query_lens)

    def keeps(self, layers: tuple[int, ...]) -> bool:
        """Whether a replay leaves the features of ``layers`` in the model's ``captured_hidden``, as an
        eager forward does (the layers it captured when the graphs were built)."""
        return set(layers) <= set(self.captured_layers)

    def bucket_for(self, num_tokens: int, max_query_len: int) -> tuple[int, int] | None:
        """The graph that serves a step, or None when it is too large or its queries too long."""
        qlen = next((q for q in self.max_query_lens if q >= max_query_len), None)
        if qlen is None or num_tokens > self.max_tokens:
            return None
        tokens = next(b for b in self.buckets if b >= num_tokens)
        return tokens, qlen

    def stage(self, bucket: tuple[int, int], ids: list[int], positions: list[int], slots: list[int],
              seq_lens: list[int], starts: list[int], tables: list[list[int]],
              state_slots: list[int] | None = None) -> GraphStep:
        """Pack a step's inputs for ``bucket`` into one pinned buffer and start its copy to the device."""
        packed, width = pack_step(bucket[0], ids, positions, slots, seq_lens, starts, tables, state_slots)
        host = torch.from_numpy(packed)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return GraphStep(bucket, len(ids), len(seq_lens), width, host.to(self.device, non_blocking=True))

    def context(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, ForwardContext]:
        """The static input ids and context of ``bucket`` (what ``StepInputs`` carries)."""
        graph = self.graphs[bucket]
        return graph.input_ids, graph.ctx

    def load(self, step: GraphStep) -> None:
        """Copy a staged step into its graph's static inputs (on the device, in stream order)."""
        graph = self.graphs[step.bucket]
        t, b, w = graph.tokens, step.num_requests, step.width
        graph.flat.copy_(step.staged[:4 * t + 1])
        graph.query_start_loc.copy_(step.staged[4 * t + 1:5 * t + 2])
        if self.stateful:
            graph.state_slots.copy_(step.staged[5 * t + 2:6 * t + 2])
        if b * w:
            self.block_tables[:b, :w].copy_(step.staged[6 * t + 2:].view(b, w))

    @torch.inference_mode()
    def load_placeholder(self, bucket: tuple[int, int]) -> None:
        """Fill ``bucket``'s static inputs with a profiling step: random token ids and distinct positions
        (0 … Tb − 1, wrapped at the longest sequence a block table holds) on the capture's scratch slots
        and lengths. The capture's own inputs (token 0 at position 0 for every row) route every row of an
        MoE layer to the same experts (a learned router sees one hidden state; balanced routing hashes
        the position), so a replay of them times a step that reads 1/Tb of the expert weights a real step
        of Tb distinct tokens reads."""
        graph = self.graphs[bucket]
        t = graph.tokens
        ids = torch.randint(0, self.model.vocab_size, (t,), generator=self._placeholder_ids)
        graph.flat[:t].copy_(ids)
        graph.flat[t:2 * t].copy_(torch.arange(t) % (self.block_tables.shape[1] * self.block_size))

    def replay(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the captured graph; returns its static ``hidden [Tb, H]`` and ``logits [Tb, V]``, and
        points the model's ``captured_hidden`` at its static features (``keeps``)."""
        graph = self.graphs[bucket]
        self.replays += 1
        if self.emulate:  # the outputs stand where a capture's would (the speculative tail reads them there)
            graph.hidden = self.model.forward(graph.input_ids, graph.ctx)
            graph.logits = self.model.compute_logits(graph.hidden, graph.ctx)
            return graph.hidden, graph.logits
        assert graph.graph is not None and graph.hidden is not None and graph.logits is not None
        graph.graph.replay()
        if graph.captured:
            self.model.captured_hidden.update(graph.captured)
        return graph.hidden, graph.logits
