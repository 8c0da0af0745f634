"""The step runner: a scheduled batch → tensors → forward → logits → sampled tokens.

Inputs are built on the host from the step's rows (``deepinfer/rows.py``: plain data the scheduler
emits; the runner never sees the engine's requests) and copied to the device once per step. Only the
rows that need logits go through the LM head: the last row of every request that samples, plus every
prompt row of requests that asked for prompt logprobs. A request that
verifies drafts (speculative decoding) sends all its rows; when any does, the step verifies instead of
sampling (``sampling/verify.py``), and requests without drafts sample exactly as they would alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.engine.context import Span, SpanLayout, forward_context
from deepinfer.engine.drafting import DraftPlan, StepTokens
from deepinfer.engine.followup import FollowUps
from deepinfer.engine.graphs import DecodeGraphs, GraphStep
from deepinfer.engine.piecewise import PiecewiseGraphs
from deepinfer.interfaces import ForwardContext
from deepinfer.model.base import CausalLM
from deepinfer.model.transfer import to_device, to_device_many, to_host
from deepinfer.rows import StepRow
from deepinfer.sampling.penalties import PenaltyRow, PenaltyState, PenaltyStep
from deepinfer.sampling.sampler import SampleResult, SamplingBatch, logprobs_of, sample
from deepinfer.sampling.verify import VerifyBatch, VerifyResult, verify
from deepinfer.structured.masks import StepMasks

if TYPE_CHECKING:
    from deepinfer.engine.tail_graphs import TailStep


@dataclass
class PromptLogprobSpan:
    """Logits rows ``[lo, lo + count)`` of one request score prompt tokens from ``first_target``."""

    row: StepRow
    lo: int
    count: int
    first_target: int


@dataclass
class StepInputs:
    """Everything the forward and the sampler need for one step."""

    input_ids: torch.Tensor
    ctx: ForwardContext
    logits_indices: torch.Tensor
    samplers: list[StepRow]
    sample_rows: torch.Tensor | None  # the logits rows that sample; None: all of them, in order (no prompt logprobs)
    sampling: SamplingBatch | None
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)
    # Rows whose input token was sampled by the previous step and is still on the device, with the
    # request each belongs to; the executor fills them from that step's results before the forward.
    pending_rows: list[int] = field(default_factory=list)
    pending_requests: list[str] = field(default_factory=list)
    verify: VerifyBatch | None = None
    # Structured output: bitmasks of the structured sampler rows, filled by the host (EngineCore.prepare /
    # process) while the forward runs; sampling waits for them.
    grammar: StepMasks | None = None
    # Set when the step replays a CUDA graph: its inputs, staged for the graph's static buffers.
    graph: GraphStep | None = None
    # Set when the step's forward replays the piecewise graphs (engine/piecewise.py): a step with prompt rows.
    piecewise: bool = False
    # Logits processing (penalties, logit bias, allowed tokens, early-EOS ban) of the step's sampled rows.
    penalties: PenaltyStep | None = None
    # Speculative decoding: the drafting that runs on the device right after the step's sampling, and the
    # follow-up rows fixed up on the device from the previous step's results before the forward.
    drafting: DraftPlan | None = None
    followups: FollowUps | None = None
    # Set when the step's verification and drafting replay the speculative tail's graph (engine/tail_graphs.py):
    # ``execute`` then runs the forward alone.
    tail: TailStep | None = None


@dataclass
class StepResults:
    """Device results of a step; the host reads them once, in ``process``."""

    samplers: list[StepRow]
    sampled: SampleResult | None
    prompt_spans: list[PromptLogprobSpan]
    prompt_logits: torch.Tensor | None
    verified: VerifyResult | None = None
    # The step's hidden states (row order of the step's tokens; a replayed graph's whole bucket), kept only
    # when the runner's ``keep_hidden`` is set, for the drafting right after the step (``engine/drafting.py``):
    # the final ones (MTP), or with ``hidden_layers`` set those layers' inputs, ``[T, H · layers]`` (dspark).
    hidden: torch.Tensor | None = None
    # Speculative decoding: the proposal drafted on the device right after the step (``Speculator.draft``),
    # with a host copy the host reads with the step's tokens; per sampling row, how far its positions moved
    # (a follow-up row, ``engine/followup.py``; None: no row moved).
    proposal: Any = None
    moved: torch.Tensor | None = None
    # On CUDA: ``sampled``/``verified`` (and the proposal) copied to pinned host memory, complete once
    # ``ready`` has fired (``host_results``); the host waits on that one event, not on the stream.
    host_sampled: SampleResult | None = None
    host_verified: VerifyResult | None = None
    ready: torch.cuda.Event | None = None
    # On CUDA: recorded on the stream before the step's first kernel (with ``ready``, the step's device span).
    started: torch.cuda.Event | None = None
    # On CUDA: recorded between the LM head and the sampler, and after the sampler (before any drafting),
    # splitting the device span (``time_split``).
    forwarded: torch.cuda.Event | None = None
    sampled_at: torch.cuda.Event | None = None
    # Host seconds of the forward (LM head included), of the sampler and of the drafting: the split off CUDA.
    host_split: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def host_results(self) -> tuple[SampleResult | None, VerifyResult | None]:
        """``sampled`` and ``verified`` readable on the host: the pinned copies once the step's event has
        fired (CUDA), else the results themselves."""
        if self.ready is None:
            return self.sampled, self.verified
        self.ready.synchronize()
        return self.host_sampled, self.host_verified

    def tokens(self, device: torch.device) -> StepTokens:
        """The emitted tokens, accepted counts and fix-up moves of every sampling row, on the device."""
        if self.verified is not None:
            return StepTokens(self.verified.tokens, self.verified.num_accepted, self.moved)
        sampled = self.sampled.tokens if self.sampled is not None else torch.zeros(0, dtype=torch.int64, device=device)
        return StepTokens(sampled.unsqueeze(1), torch.zeros_like(sampled), self.moved)

    def time_split(self) -> tuple[float, float, float]:
        """``(forward, sampler, drafting)`` seconds of the step: forward with the LM head, then sampling or
        verification, then drafting (with the copy of the results to the host). On CUDA from the step's
        events, read after ``host_results`` (they have fired then: no wait); elsewhere the host's clock."""
        if self.started is None or self.forwarded is None or self.sampled_at is None or self.ready is None:
            return self.host_split
        return (self.started.elapsed_time(self.forwarded) / 1000, self.forwarded.elapsed_time(self.sampled_at) / 1000,
                self.sampled_at.elapsed_time(self.ready) / 1000)


class ModelRunner:
    """Runs scheduled batches through one model on one device."""

    def __init__(self, model: CausalLM, backends: Mapping[str, object], block_size: int,
                 device: torch.device, *, graphs: DecodeGraphs | None = None,
                 piecewise: PiecewiseGraphs | None = None, stateful: bool = False, keep_hidden: bool = False,
                 hidden_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.backends = backends
        self.block_size = block_size
        self.device = device
        # Models with per-request state (kv/state.py): the contexts then carry each row's state slot and
        # write floor (the positions below which its blocks are shared: exact replay must not rewrite them).
        self.stateful = stateful
        # The drafter reads the main model's rows (MTP, dspark): results keep ``hidden``.
        self.keep_hidden = keep_hidden
        # Decode-shaped steps replay these CUDA graphs (engine/graphs.py) when given.
        self.graphs = graphs
        # Other steps that fit its buckets (prompt rows) replay the forward in pieces (engine/piecewise.py), when
        # the pieces keep the layer features the drafter reads.
        self.piecewise = piecewise if piecewise is not None and piecewise.keeps(hidden_layers) else None
        self._placeholder_ids = torch.Generator().manual_seed(0)  # placeholder_step's token ids
        self._last_ready: torch.cuda.Event | None = None  # the previous step's end, for device_span
        # With ``keep_hidden``, when the drafter reads chosen layers' features (dspark, the model's
        # ``capture_hidden``): the kept ``hidden`` is then those layers' inputs, concatenated in this order.
        self.hidden_layers = hidden_layers
        # Device-side token counts and biases of requests that process logits, built by the first such one.
        self.penalties: PenaltyState | None = None
        # Whether some backend reads a context's host lists (off CUDA they cost nothing to make exact; on CUDA
        # only backends that are not graph_safe read them): see ``exact_host_lists``.
        ops = getattr(model, "backend_ops", None) or frozenset(backends)  # the ops the model calls
        self.reads_host_lists = device.type != "cuda" or not all(
            backends[op].capabilities.graph_safe for op in ops if op in backends)

    def exact_host_lists(self, ctx: ForwardContext) -> None:
        """Make the host lists of a context whose device tensors were computed on the device (drafting
        rows, rows fixed up from the previous step's results) match them, when some backend reads them: a
        read of the device, free off CUDA; graph-safe CUDA backends read only the tensors."""
        if not self.reads_host_lists:
            return
        ctx.seq_lens_host = ctx.seq_lens.tolist()
        ctx.query_start_loc_host = ctx.query_start_loc.tolist()
        if ctx.state_slots is not None:
            ctx.state_slots_host = ctx.state_slots.tolist()

    def prepare(self, rows: Sequence[StepRow]) -> StepInputs:
        """Flatten the step's rows (decode rows first): token ids, positions, cache slots, block tables,
        logits rows."""
        layout = SpanLayout.of([(s.block_table, s.start, s.num_new_tokens) for s in rows], self.block_size)
        ids: list[int] = []
        logits_rows: list[int] = []
        samplers: list[StepRow] = []
        sample_rows: list[int] = []
        spans: list[PromptLogprobSpan] = []
        pending_rows: list[int] = []
        pending_requests: list[str] = []
        for s, first_row in zip(rows, layout.starts, strict=False):
            n = s.num_new_tokens
            ids.extend(s.token_ids)
            if s.pending_offset >= 0:
                pending_rows.append(first_row + s.pending_offset)
                pending_requests.append(s.request_id)
            if s.prompt_targets:
                count = len(s.prompt_targets)
                spans.append(PromptLogprobSpan(s, len(logits_rows), count, s.start + 1))
                logits_rows.extend(range(first_row, first_row + count))
            if s.samples:
                samplers.append(s)
                sample_rows.extend(range(len(logits_rows), len(logits_rows) + 1 + s.draft_rows))
                logits_rows.extend(range(first_row + n - 1 - s.draft_rows, first_row + n))
        dev = self.device

        def tensor(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return to_device(values, dtype, dev)  # never waits for the device (launch path)

        # Bounded replay: restore floors, and the YoCo truncation of chunks of a truncated prefill.
        floors = [s.visibility_floor for s in rows]
        truncations = [s.truncation for s in rows]
        has_floor, has_truncation = any(floors), any(t is not None for t in truncations)
        state_slots = write_floors = None
        if self.stateful:
            state_slots, write_floors = [s.state_slot for s in rows], [s.write_floor for s in rows]
        replaying = write_floors is not None and any(f > s.start for f, s in zip(write_floors, rows, strict=True))
        bucket = None
        # Graphs carry neither replay floors, state rebuilt below a write floor, nor captured layer
        # features they do not keep (dspark's hidden_layers; V4's MTP input they keep): eager then.
        if (self.graphs is not None and not spans and not (has_floor or has_truncation or replaying)
                and self.graphs.keeps(self.hidden_layers)):
            bucket = self.graphs.bucket_for(len(ids), layout.max_query_len)
        graph = None
        # Other steps (prompt rows) replay the forward in pieces.
        piecewise = (bucket is None and self.piecewise is not None and not has_truncation and not replaying
                     and self.piecewise.serves(len(ids)))
        if bucket is not None:
            assert self.graphs is not None
            graph = self.graphs.stage(bucket, ids, layout.positions, layout.slots, layout.seq_lens, layout.starts,
                                      layout.tables, state_slots)
            input_ids, ctx = self.graphs.context(bucket)
        else:
            input_ids = tensor(ids)
            ctx = forward_context(layout, block_size=self.block_size, backends=self.backends, device=dev,
                                  state_slots=state_slots, write_floors=write_floors)
        if has_floor:
            ctx.visibility_floor_host = floors
            ctx.visibility_floor = tensor(floors)
        if has_truncation:
            ctx.truncation_floor_host = [t.visibility_floor if t else 0 for t in truncations]
            ctx.truncation_compact_host = [t is not None and t.mode == "compact" for t in truncations]
        # The rows read, the sampling batch and the verification inputs: one copy per dtype for all of them.
        fields: dict[str, tuple[list, torch.dtype]] = {"logits": (logits_rows, torch.int64)}
        if spans:  # else every logits row samples, in order
            fields["sample"] = (sample_rows, torch.int64)
        params = [s.params for s in samplers]
        forcing = any(p.golden_token_ids for p in params)
        verifying = any(s.draft_rows for s in samplers)
        if samplers:
            fields |= {f"sampling.{name}": value for name, value in SamplingBatch.fields(
                params, [s.seed for s in samplers], [s.counter for s in samplers],
                [_forced(s, 0) for s in samplers] if forcing else None).items()}
        if verifying:
            fields |= {f"verify.{name}": value for name, value in self._verify_fields(samplers, forcing).items()}
        sent = dict(zip(fields, to_device_many(list(fields.values()), dev), strict=True))
        sampling = verify_batch = None
        if samplers:
            sampling = SamplingBatch.of(_fields_of(sent, "sampling."), params)
        if verifying:
            assert sampling is not None
            verify_batch = self._verify_batch(samplers, sampling, _fields_of(sent, "verify."))
        penalties = self._penalty_step(samplers)
        return StepInputs(input_ids, ctx, sent["logits"], samplers, sent.get("sample"), sampling, spans,
                          pending_rows, pending_requests, verify_batch, graph=graph, piecewise=piecewise,
                          penalties=penalties)

    def _penalty_step(self, samplers: list[StepRow]) -> PenaltyStep | None:
        """The logits processing of the step's sampling rows (None when none asks for any)."""
        if not any(s.params.processes_logits for s in samplers):
            return None
        if self.penalties is None:
            self.penalties = PenaltyState(self.model.vocab_size, self.device)
        rows, first = [], 0
        for s in samplers:
            rows.append(PenaltyRow(s.request_id, s.epoch, s.params, s.prompt_token_ids, s.output_token_ids, first,
                                   s.token_slot - s.num_prompt_tokens, s.drafts, s.banned_eos))
            first += 1 + len(s.drafts)
        return self.penalties.plan(rows, max(len(s.drafts) for s in samplers))

    def release_request(self, request_id: str) -> None:
        """A request finished: free what the runner keeps for it (its logits-processing slot)."""
        if self.penalties is not None:
            self.penalties.release(request_id)

    @staticmethod
    def _verify_fields(samplers: list[StepRow], forcing: bool) -> dict[str, tuple[list, torch.dtype]]:
        """The host lists of the step's ``VerifyBatch`` by field, ``(values, dtype)`` (``_verify_batch``)."""
        k = max(s.draft_rows for s in samplers)
        row_start, row_request, row_offset = [], [], []
        for i, s in enumerate(samplers):
            row_start.append(len(row_request))
            row_request.extend([i] * (1 + s.draft_rows))
            row_offset.extend(range(1 + s.draft_rows))
        params = [s.params for s in samplers]
        i64, f32 = torch.int64, torch.float32
        fields = {
            "drafts": ([[*s.drafts] + [-1] * (k - len(s.drafts)) for s in samplers], i64),
            "row_start": (row_start, i64),
            "num_drafts": ([s.draft_rows for s in samplers], i64),  # a follow-up's: fixed up on the device
            "random_requests": ([i for i, p in enumerate(params) if not p.greedy], i64),
            "temperature": ([p.temperature if not p.greedy else 1.0 for p in params], f32),
            "top_k": ([max(p.top_k, 0) for p in params], i64),
            "top_p": ([p.top_p for p in params], f32),
            "min_p": ([p.min_p for p in params], f32),
            "seeds": ([s.seed for s in samplers], i64),
            "base": ([s.counter for s in samplers], i64),
            "row_request": (row_request, i64),
            "row_offset": (row_offset, i64),
        }
        if forcing:
            fields["forced"] = ([[_forced(s, j) for j in range(k + 1)] for s in samplers], i64)
        return fields

    def _verify_batch(self, samplers: list[StepRow], sampling: SamplingBatch, sent: dict[str, torch.Tensor]
                      ) -> VerifyBatch:
        """The step's ``VerifyBatch`` from ``_verify_fields``' lists on the device (``sent``, by field)."""
        dev = self.device
        k = max(s.draft_rows for s in samplers)
        probs = None
        if any(s.draft_probs is not None for s in samplers):
            probs = torch.zeros(len(samplers), k, self.model.vocab_size, device=dev)
            for i, s in enumerate(samplers):
                n = len(s.drafts)
                if s.draft_probs is not None:
                    probs[i, :n] = s.draft_probs[:n]
                elif n:
                    probs[i, :n].scatter_(-1, sent["drafts"][i, :n, None], 1.0)
        return VerifyBatch(draft_probs=probs, sampling=sampling, forced=sent.pop("forced", None), **sent)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, fill: tuple[torch.Tensor, torch.Tensor] | None = None,
                previous: StepResults | None = None) -> StepResults:
        """Forward, LM head on the selected rows, and sampling (all on the device). ``fill`` =
        ``(rows, tokens)`` writes tokens still on the device into ``input_ids`` first; ``previous`` (the
        step before, still unread by the host) fixes up the step's follow-up rows (``engine/followup.py``)."""
        started = forwarded = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        t0 = time.perf_counter()
        if inputs.graph is not None:
            assert self.graphs is not None
            self.graphs.load(inputs.graph)
        if fill is not None:
            inputs.input_ids[fill[0]] = fill[1]
        moved = None
        if inputs.followups is not None:
            assert previous is not None, "a follow-up row needs the step before it"
            inputs.verify, moved = inputs.followups.apply(previous.tokens(self.device), previous.proposal,
                                                          inputs.input_ids, inputs.ctx, inputs.sampling, inputs.verify,
                                                          len(inputs.samplers), self.model.vocab_size)
            if inputs.graph is None:  # a graph's host lists stay the capture's (graph-safe backends ignore them)
                self.exact_host_lists(inputs.ctx)
        if inputs.graph is not None:
            assert self.graphs is not None
            hidden, all_logits = self.graphs.replay(inputs.graph.bucket)
            # (the speculative tail reads the bucket's logits itself)
            logits = all_logits if inputs.tail is not None else all_logits.index_select(0, inputs.logits_indices)
        else:
            if inputs.piecewise:
                assert self.piecewise is not None
                hidden = self.piecewise.forward(inputs.input_ids, inputs.ctx)
            else:
                hidden = self.model.forward(inputs.input_ids, inputs.ctx)
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices), inputs.ctx)
        t1 = time.perf_counter()
        if self.device.type == "cuda":
            forwarded = torch.cuda.Event(enable_timing=True)
            forwarded.record()
        sampled = verified = None
        if inputs.tail is None and (inputs.verify is not None or inputs.sampling is not None):
            # Without prompt logprobs every logits row samples, in order: no copy (on the 2-core CPU a batch-64
            # bf16 SmolLM2 step went from ~55 to ~52.5 ms without it)
            rows = logits if inputs.sample_rows is None else logits.index_select(0, inputs.sample_rows)
            # Penalties and biases adjust a copy; grammar masks go on top; logprobs read the raw rows.
            adjusted = rows
            if inputs.penalties is not None:
                assert self.penalties is not None
                adjusted = self.penalties.apply(inputs.penalties, rows)
            if inputs.verify is not None:
                target = adjusted if inputs.grammar is None else inputs.grammar.constrain(adjusted)
                verified = verify(target, inputs.verify, raw_logits=rows)
            else:
                assert inputs.sampling is not None
                sampled = _sample(adjusted, rows, inputs.sampling, inputs.grammar)
            if inputs.penalties is not None:
                assert self.penalties is not None
                emitted = verified.tokens if verified is not None else sampled.tokens  # type: ignore[union-attr]
                self.penalties.record(inputs.penalties, emitted)
        host_split = (t1 - t0, time.perf_counter() - t1, 0.0)
        kept = None  # the speculative tail's graph reads the bucket's static features itself
        if inputs.tail is None and self.keep_hidden:
            kept = hidden
            if self.hidden_layers:
                kept = torch.cat([self.model.captured_hidden[i] for i in self.hidden_layers], dim=-1)
        results = StepResults(inputs.samplers, sampled, inputs.prompt_spans,
                              logits if inputs.prompt_spans else None, verified, kept, moved=moved,
                              host_split=host_split)
        if self.device.type == "cuda":
            results.started = started
            results.forwarded = forwarded
            results.sampled_at = torch.cuda.Event(enable_timing=True)
            results.sampled_at.record()
        return results

    def seal(self, results: StepResults) -> None:
        """The step's device work is launched (drafting included): start the copies of its results to the
        host and record the one event the host waits on (CUDA; elsewhere nothing to do)."""
        if self.device.type != "cuda":
            return
        results.host_sampled = to_host(results.sampled) if results.sampled is not None else None
        results.host_verified = to_host(results.verified) if results.verified is not None else None
        if results.proposal is not None:
            results.proposal.copy_to_host()
        results.ready = torch.cuda.Event(enable_timing=True)
        results.ready.record()

    def work_drained(self) -> None:
        """No request is left: the wait until the next one arrives is not the device's idle time."""
        self._last_ready = None

    def device_span(self, results: StepResults) -> tuple[float, float]:
        """``(busy, idle)`` seconds of the device for a step whose results were read: from its first
        kernel to its results, and the gap since the previous step's results (0 for the first step, or
        off CUDA). Call once per step, in step order."""
        if results.started is None or results.ready is None:
            return 0.0, 0.0
        busy = results.started.elapsed_time(results.ready) / 1000
        previous, self._last_ready = self._last_ready, results.ready
        idle = previous.elapsed_time(results.started) / 1000 if previous is not None else 0.0
        return busy, max(0.0, idle)

    def span_context(self, spans: Sequence[Span]) -> ForwardContext:
        """A ``ForwardContext`` over ``spans`` of ``(block table, first position, count)``: each a request
        computing positions ``[first, first + count)`` on its blocks, KV length ``first + count``. Spans of
        one position must come first (they are the context's decode rows). For drafters that run layers of
        their own over the main paging (``CommittedRows``); state slots, for models with per-request state,
        are the caller's to set (``DraftCache.rows``)."""
        return forward_context(SpanLayout.of(spans, self.block_size), block_size=self.block_size,
                               backends=self.backends, device=self.device)

    @torch.inference_mode()
    def placeholder_step(self, num_tokens: int, tokens_per_request: int = 1) -> None:
        """Forward and LM head over ``num_tokens`` query tokens split into requests of
        ``tokens_per_request`` tokens (the last one shorter) at positions 0…, random token ids, all writing
        the reserved scratch block 0: the step-cost profile times this (contents are garbage). With
        ``tokens_per_request = 1 + max_draft`` the rows are shaped like a verification step."""
        lengths = [tokens_per_request] * (num_tokens // tokens_per_request)
        if num_tokens % tokens_per_request:
            lengths.insert(0, num_tokens % tokens_per_request)  # a one-token request must lead (decode rows)
        scratch = (0,) * -(-max(lengths) // self.block_size)  # block 0, as many times as the longest needs
        # Reserved slot 0 absorbs the placeholder's per-request state, as block 0 its KV.
        idle = [0] * len(lengths) if self.stateful else None
        ctx = forward_context(SpanLayout.of([(scratch, 0, n) for n in lengths], self.block_size),
                              block_size=self.block_size, backends=self.backends, device=self.device,
                              state_slots=idle, write_floors=idle)
        # Random ids: one id repeated would route every row of an MoE layer to the same experts.
        ids = torch.randint(0, self.model.vocab_size, (num_tokens,), generator=self._placeholder_ids).to(self.device)
        hidden = self.model.forward(ids, ctx)
        self.model.compute_logits(hidden, ctx)


def _fields_of(sent: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of ``sent`` whose names start with ``prefix``, by the rest of their names."""
    return {name.removeprefix(prefix): t for name, t in sent.items() if name.startswith(prefix)}


def _forced(s: StepRow, j: int) -> int:
    """The golden token the row must emit as its ``j``-th token of this step, or −1."""
    golden = s.params.golden_token_ids
    m = s.token_slot - s.num_prompt_tokens + j
    return golden[m] if golden and m < len(golden) else -1


def _sample(adjusted: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch, grammar: StepMasks | None
            ) -> SampleResult:
    """Sample from ``adjusted`` (grammar-masked when ``grammar``), logprobs from the ``raw`` rows."""
    if adjusted is raw:
        return sample(raw, batch) if grammar is None else grammar.sample(raw, batch)
    plain = dataclasses.replace(batch, num_logprobs=-1)
    result = sample(adjusted, plain) if grammar is None else grammar.sample(adjusted, plain)
    if batch.num_logprobs < 0:
        return result
    token_lp, top_lp, top_ids = logprobs_of(raw, result.tokens, batch.num_logprobs)
    return SampleResult(result.tokens, token_lp, top_lp, top_ids)


def prompt_logprobs_of(results: StepResults) -> list[tuple[StepRow, int, list[dict[int, float]]]]:
    """Per span: the step row, the first prompt position scored, and one ``{token: logprob}`` per row
    (the actual prompt token plus the top-n). Reads the device (called in ``process``)."""
    out = []
    assert results.prompt_logits is not None
    for span in results.prompt_spans:
        row = span.row
        targets = torch.tensor(row.prompt_targets, device=results.prompt_logits.device)
        logits = results.prompt_logits[span.lo:span.lo + span.count]
        lp, top_lp, top_ids = logprobs_of(logits, targets, row.params.prompt_logprobs or 0)
        rows = []
        for t, v, tl, ti in zip(targets.tolist(), lp.tolist(), top_lp.tolist(), top_ids.tolist(), strict=True):
            entry = dict(zip(ti, tl, strict=True))
            entry[t] = v
            rows.append(entry)
        out.append((span.row, span.first_target, rows))
    return out
