"""The speculative tail in CUDA graphs: a replayed decode step's verification and drafting, one replay.

A speculative step whose forward replays a decode graph (``engine/graphs.py``) still has its tail to run:
greedy verification of the drafts, the drafter's inputs from the accepted counts (``engine/drafting.py``),
the drafter's passes and the proposal's masks (``Speculator.draft``). Eagerly that is ~130 small kernels,
each paid in host launch time: on the H200 with SmolLM2 ~2 ms of a 5.3 ms step, against a 2.9 ms step
without speculation. ``TailGraphs`` captures the whole tail once per (rows bucket ``t`` of the target's
graph, samplers bucket ``s``: the power of two at or above the step's requests) and replays it, so a
speculative step is two replays and a few copies, as the reference's drafting graph runner makes it.

**Which steps.** Decode-only steps that replay a target graph, every request greedy, with no grammar
mask, logits processing, logprobs or forced tokens, and a drafter that can be captured
(``interfaces.GraphDrafter``); the others run the eager tail, as before. Verification always runs
``K = max_draft`` columns: a request verifies its own ``num_drafts`` of them, and a step that verifies
nothing is a greedy verification of zero drafts (its final token is the row's argmax, what the sampler
picks).

**Inputs.** The host packs every list of the tail into one int64 vector laid out for the key
(``TailLayout``: the drafts ``[s, K]``, each request's first row, draft count, and the drafting plan's
per-request fields padded to ``s``, the emitted rows padded to ``t``), sends it with one copy when it
prepares the step, and hands the runner's ``VerifyBatch`` views of it, so follow-up rows fixed up on the
device (``engine/followup.py``) write their drafts into it before the replay copies it into the graph's
static buffer. Padding: requests past the real ones verify nothing (row 0, no drafts); drafting rows past
the plan's draft for sampler 0 with no room (their drafts are dropped); emitted rows past the step's are
the target graph's padding rows, whose context rows the drafter writes to the scratch slot 0.

**Outputs** are the graph's static tensors sliced to the real rows: valid until the next replay of a tail
graph, which stream order puts after every reader of this step's results (the host copies, the next
step's fix-up of its follow-up rows). The target graph's outputs it reads (logits, layer features,
context) are likewise the bucket's static ones.

Capture happens on first use of a key, on the calling thread (the engine's device thread under the
overlapped executor), on a side stream in thread-local mode, after one eager warm-up on the same inputs;
the tail is idempotent (a context row written twice holds the same values), so the warm-up changes
nothing. ``emulate`` runs the tail eagerly on the static buffers instead (no CUDA): the CPU tests check the
packing and the padding with it.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.drafting import DraftPlan, StepTokens
from deepinfer.engine.graphs import DecodeGraphs
from deepinfer.engine.runner import StepInputs, StepResults
from deepinfer.engine.speculation import DeviceProposal, Speculator
from deepinfer.interfaces import GraphDrafter
from deepinfer.sampling.sampler import SampleResult, SamplingBatch
from deepinfer.sampling.verify import VerifyBatch, VerifyResult, verify

TailKey = tuple[int, int]  # (target graph's rows bucket, samplers bucket)


@dataclass(frozen=True)
class TailLayout:
    """Where each field sits in the packed int64 vector of a key's ``s`` samplers, ``t`` rows and ``k`` draft
    columns: ``(offset, size)`` by name, in this order."""

    s: int
    t: int
    k: int

    def fields(self) -> dict[str, tuple[int, int]]:
        s, t = self.s, self.t
        sizes = {"drafts": s * self.k, "row_start": s, "num_drafts": s, "samplers": s, "positions": s,
                 "rooms": s, "last_rows": s, "coverage": s, "seeds": s, "emitted_rows": t, "emitted_at": t}
        out, at = {}, 0
        for name, size in sizes.items():
            out[name] = (at, size)
            at += size
        return out

    @property
    def size(self) -> int:
        return sum(n for _, n in self.fields().values())

    def views(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields of ``packed`` as views (``drafts`` ``[s, k]``)."""
        out = {name: packed[at:at + n] for name, (at, n) in self.fields().items()}
        out["drafts"] = out["drafts"].view(self.s, self.k)
        return out


@dataclass
class TailStep:
    """A step's tail as the host staged it: its graph ``key``, ``num_samplers`` real requests, the real
    drafting ``plan`` and the ``padded`` one the graph was captured with (the host's shape facts),
    ``verifying`` (whether the step has drafts to verify) and ``staged``, the packed inputs on the device."""

    key: TailKey
    num_samplers: int
    plan: DraftPlan
    padded: DraftPlan
    verifying: bool
    staged: torch.Tensor


class _Tail:
    """One captured key: static inputs, the graph and its outputs."""

    def __init__(self, layout: TailLayout, device: torch.device) -> None:
        s = layout.s
        self.packed = torch.zeros(layout.size, dtype=torch.int64, device=device)
        self.views = layout.views(self.packed)
        self.moved = torch.zeros(s, dtype=torch.int64, device=device)
        self.next_tokens = torch.zeros(layout.t, dtype=torch.int64, device=device)  # written in place by the tail
        self.greedy = torch.zeros(s, dtype=torch.float32, device=device)  # temperature 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()


def _greedy_batch(views: dict[str, torch.Tensor], device: torch.device) -> VerifyBatch:
    """A ``VerifyBatch`` of greedy requests over the tail's static views (the sampling fields are empty:
    greedy verification reads only the drafts, their count and each request's first row)."""
    i64, f32 = torch.int64, torch.float32
    none = torch.empty(0, dtype=i64, device=device)
    nonef = torch.empty(0, dtype=f32, device=device)
    sampling = SamplingBatch(temperature=nonef, top_k=none, top_p=nonef, min_p=nonef, seeds=none, positions=none,
                             random_rows=none, sorted_rows=none, plain_rows=none, num_logprobs=-1)
    return VerifyBatch(row_start=views["row_start"], drafts=views["drafts"], num_drafts=views["num_drafts"],
                       draft_probs=None, random_requests=none, temperature=nonef, top_k=none, top_p=nonef,
                       min_p=nonef, seeds=none, base=none, sampling=sampling, row_request=none, row_offset=none)


class TailGraphs:
    """Captures and replays the speculative tail of replayed decode steps (module docstring)."""

    def __init__(self, graphs: DecodeGraphs, speculator: Speculator, hidden_layers: tuple[int, ...],
                 emulate: bool = False) -> None:
        self.graphs = graphs
        self.speculator = speculator
        self.drafter = speculator.drafter
        assert isinstance(self.drafter, GraphDrafter)
        self.hidden_layers = hidden_layers  # the layer features the drafter reads (dspark), else the final hidden
        self.k = speculator.max_draft
        self.emulate = emulate
        self.device = graphs.device
        self.tails: dict[TailKey, _Tail] = {}
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.replays = 0

    # ------------------------------------------------------------------------------------ host side

    def stage(self, inputs: StepInputs) -> TailStep | None:
        """Pack the tail of a prepared step and start its copy to the device; None when the step does not
        qualify (module docstring: it then runs the eager tail). Points the step's ``VerifyBatch`` at the
        packed drafts, so that a fix-up of follow-up rows lands in them."""
        plan, graph = inputs.drafting, inputs.graph
        samplers = inputs.samplers
        if plan is None or graph is None or not plan.samplers:
            return None
        if (inputs.grammar is not None or inputs.penalties is not None or inputs.prompt_spans
                or len(samplers) != graph.num_requests or len(plan.emitted_rows) != graph.num_tokens
                or any(not s.params.greedy or s.params.logprobs is not None or s.params.golden_token_ids
                       or s.draft_probs is not None for s in samplers)):
            return None
        t = graph.bucket[0]
        s = 1 << (len(samplers) - 1).bit_length()  # few keys: each costs a capture while serving
        layout = TailLayout(s, t, self.k)
        packed = np.zeros(layout.size, dtype=np.int64)
        views = {name: packed[at:at + n] for name, (at, n) in layout.fields().items()}
        drafts = views["drafts"].reshape(s, self.k)
        drafts[:] = -1
        first = 0
        for i, row in enumerate(samplers):
            drafts[i, :len(row.drafts)] = row.drafts
            views["row_start"][i] = first
            views["num_drafts"][i] = row.draft_rows
            first += 1 + row.draft_rows
        b = len(plan.samplers)
        views["samplers"][:b] = plan.samplers
        views["positions"][:b] = plan.positions
        views["positions"][b:] = 1  # padding drafting rows: a window at position 0 that nothing sees
        views["rooms"][:b] = plan.rooms
        views["last_rows"][:b] = plan.last_rows
        views["coverage"][:b] = plan.coverage
        views["seeds"][:b] = plan.seeds
        e = len(plan.emitted_rows)
        views["emitted_rows"][:e] = plan.emitted_rows
        views["emitted_rows"][e:] = np.arange(e, t)  # the target graph's padding rows
        views["emitted_at"][:e] = [i * (self.k + 1) + j for i, j in plan.emitted_from]
        host = torch.from_numpy(packed)
        if self.device.type == "cuda":
            host = host.pin_memory()
        staged = host.to(self.device, non_blocking=True)
        if inputs.verify is not None:
            sent = layout.views(staged)
            n = len(samplers)
            inputs.verify = dataclasses.replace(inputs.verify, drafts=sent["drafts"][:n],
                                                num_drafts=sent["num_drafts"][:n], row_start=sent["row_start"][:n])
        pad = s - b
        padded = dataclasses.replace(
            plan, samplers=[*plan.samplers, *[0] * pad], request_ids=[*plan.request_ids, *[""] * pad],
            last_rows=[*plan.last_rows, *[0] * pad], positions=[*plan.positions, *[1] * pad],
            rooms=[*plan.rooms, *[0] * pad], coverage=[*plan.coverage, *[0] * pad],
            tables=[[0]] * s, seeds=[*plan.seeds, *[0] * pad], temperatures=[0.0] * s, next_tokens=[0] * t,
            emitted_rows=views["emitted_rows"].tolist(), emitted_from=[(0, 0)] * t)
        return TailStep((t, s), len(samplers), plan, padded, inputs.verify is not None, staged)

    # ---------------------------------------------------------------------------------- device side

    @torch.inference_mode()
    def run(self, step: TailStep, inputs: StepInputs, results: StepResults) -> None:
        """Verify and draft a step whose forward replayed its target graph: fills ``results``' tokens
        (``verified``, or ``sampled`` when nothing was verified) and ``proposal``."""
        self.drafter.settle()
        tail = self.tails.get(step.key)
        fresh = tail is None
        if tail is None:
            tail = self.tails[step.key] = _Tail(TailLayout(step.key[1], step.key[0], self.k), self.device)
        tail.packed.copy_(step.staged)
        tail.moved.zero_()  # how far follow-up rows moved (engine/followup.py); 0 for the others
        if results.moved is not None:
            tail.moved[:results.moved.shape[0]].copy_(results.moved)
        if self.emulate:
            tail.outputs = self._tail(tail, step, inputs)
        elif fresh:
            self._capture(tail, step, inputs)
        assert self.emulate or tail.graph is not None
        if not self.emulate:
            tail.graph.replay()
        self.replays += 1
        tokens, accepted, drafts, confidence, raw = tail.outputs
        n, b = step.num_samplers, len(step.plan.samplers)
        if step.verifying:
            results.verified = VerifyResult(tokens[:n], accepted[:n])
        else:
            results.sampled = SampleResult(tokens[:n, 0])
        results.proposal = DeviceProposal(step.plan, drafts[:b], confidence[:b], raw[:b], None)

    def _tail(self, tail: _Tail, step: TailStep, inputs: StepInputs) -> tuple[torch.Tensor, ...]:
        """The captured work: greedy verification over the target graph's logits, then the drafting."""
        assert inputs.graph is not None
        graph = self.graphs.graphs[inputs.graph.bucket]
        assert graph.logits is not None and graph.hidden is not None
        views = tail.views
        verified = verify(graph.logits, _greedy_batch(views, self.device))
        tokens = StepTokens(verified.tokens, verified.num_accepted, tail.moved)
        hidden = graph.hidden
        if self.hidden_layers:  # the bucket's static features (an emulated replay leaves them in the model)
            features = graph.captured or self.graphs.model.captured_hidden
            hidden = torch.cat([features[i] for i in self.hidden_layers], dim=-1)
        ctx = graph.ctx
        sent = {name: views[name] for name in ("samplers", "positions", "rooms", "last_rows", "coverage", "seeds",
                                               "emitted_rows", "emitted_at")}
        sent |= {"tables": ctx.block_tables.index_select(0, views["samplers"]), "temperature": tail.greedy,
                 "next_tokens": tail.next_tokens}
        proposal = self.speculator.draft(step.padded, graph.input_ids, ctx, hidden, tokens, sent=sent)
        return verified.tokens, verified.num_accepted, proposal.tokens, proposal.confidence, proposal.raw_confidence

    def _capture(self, tail: _Tail, step: TailStep, inputs: StepInputs) -> None:
        """Warm up, then capture ``_tail`` for ``step``'s key on a side stream (module docstring)."""
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        gc.disable()  # as in draft_graphs: no collection may free an old graph during the capture
        try:
            with torch.cuda.stream(stream):
                self._tail(tail, step, inputs)
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    tail.outputs = self._tail(tail, step, inputs)
                finally:
                    graph.capture_end()
        finally:
            gc.enable()
        current.wait_stream(stream)
        tail.graph = graph
