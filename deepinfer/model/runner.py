"""The step runner: a scheduled batch → tensors → forward → logits → sampled tokens.

Inputs are built on the host from the requests' tokens and block tables and copied to the device
once per step. Only the rows that need logits go through the LM head: the last row of every request
that samples, plus every prompt row of requests that asked for prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from deepinfer.interfaces import ForwardContext
from deepinfer.model.base import CausalLM
from deepinfer.sampling.sampler import SampleResult, SamplingBatch, logprobs_of, sample


@dataclass
class PromptLogprobSpan:
    """Logits rows ``[lo, lo + count)`` of one request score prompt tokens from ``first_target``."""

    scheduled: ScheduledRequest
    lo: int
    count: int
    first_target: int


@dataclass
class StepInputs:
    """Everything the forward and the sampler need for one step."""

    input_ids: torch.Tensor
    ctx: ForwardContext
    logits_indices: torch.Tensor
    samplers: list[ScheduledRequest]
    sample_rows: torch.Tensor
    sampling: SamplingBatch | None
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)
    # Rows whose input token was sampled by the previous step and is still on the device, with the
    # request each belongs to; the executor fills them from that step's results before the forward.
    pending_rows: list[int] = field(default_factory=list)
    pending_requests: list[str] = field(default_factory=list)


@dataclass
class StepResults:
    """Device results of a step; the host reads them once, in ``process``."""

    samplers: list[ScheduledRequest]
    sampled: SampleResult | None
    prompt_spans: list[PromptLogprobSpan]
    prompt_logits: torch.Tensor | None


class ModelRunner:
    """Runs scheduled batches through one model on one device."""

    def __init__(self, model: CausalLM, backends: Mapping[str, object], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.backends = backends
        self.block_size = block_size
        self.device = device

    def prepare(self, sched: SchedulerOutput, block_table: Callable[[str], list[int]]) -> StepInputs:
        """Flatten the batch: token ids, positions, cache slots, block tables, logits rows."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        samplers: list[ScheduledRequest] = []
        sample_rows: list[int] = []
        spans: list[PromptLogprobSpan] = []
        pending_rows: list[int] = []
        pending_requests: list[str] = []
        for s in sched.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            table = block_table(req.request_id)
            end = start + n
            ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            first_row = starts[-1]
            if req.num_pending and end > req.num_tokens - req.num_pending:
                pending_rows.append(first_row + req.num_tokens - req.num_pending - start)
                pending_requests.append(req.request_id)
            starts.append(first_row + n)
            seq_lens.append(end)
            tables.append(table)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                count = min(end, req.num_prompt_tokens - 1) - start
                spans.append(PromptLogprobSpan(s, len(logits_rows), count, start + 1))
                logits_rows.extend(range(first_row, first_row + count))
            if s.samples:
                samplers.append(s)
                sample_rows.append(len(logits_rows))
                logits_rows.append(first_row + n - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        num_decodes = sum(1 for s in sched.scheduled if s.num_new_tokens == 1)
        dev = self.device

        def tensor(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        ctx = ForwardContext(
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            query_start_loc=tensor(starts, torch.int32),
            seq_lens=tensor(seq_lens),
            block_tables=tensor(padded),
            num_decodes=num_decodes,
            query_start_loc_host=starts,
            seq_lens_host=seq_lens,
            block_size=bs,
            backends=self.backends,
        )
        sampling = None
        if samplers:
            sampling = SamplingBatch.build(
                [s.request.params for s in samplers],
                [s.request.seed for s in samplers],
                [s.request.num_tokens for s in samplers],
                dev,
            )
        return StepInputs(tensor(ids), ctx, tensor(logits_rows), samplers, tensor(sample_rows), sampling, spans,
                          pending_rows, pending_requests)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepResults:
        """Forward, LM head on the selected rows, and sampling (all on the device). ``fill`` =
        ``(rows, tokens)`` writes tokens still on the device into ``input_ids`` first."""
        if fill is not None:
            inputs.input_ids[fill[0]] = fill[1]
        hidden = self.model.forward(inputs.input_ids, inputs.ctx)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices), inputs.ctx)
        sampled = None
        if inputs.sampling is not None:
            sampled = sample(logits.index_select(0, inputs.sample_rows), inputs.sampling)
        return StepResults(inputs.samplers, sampled, inputs.prompt_spans, logits if inputs.prompt_spans else None)


def prompt_logprobs_of(results: StepResults) -> list[tuple[ScheduledRequest, int, list[dict[int, float]]]]:
    """Per span: the request, the first prompt position scored, and one ``{token: logprob}`` per row
    (the actual prompt token plus the top-n). Reads the device (called in ``process``)."""
    out = []
    assert results.prompt_logits is not None
    for span in results.prompt_spans:
        req = span.scheduled.request
        targets = torch.tensor(req.prompt_token_ids[span.first_target:span.first_target + span.count],
                               device=results.prompt_logits.device)
        logits = results.prompt_logits[span.lo:span.lo + span.count]
        lp, top_lp, top_ids = logprobs_of(logits, targets, req.params.prompt_logprobs or 0)
        rows = []
        for t, v, tl, ti in zip(targets.tolist(), lp.tolist(), top_lp.tolist(), top_ids.tolist(), strict=True):
            entry = dict(zip(ti, tl, strict=True))
            entry[t] = v
            rows.append(entry)
        out.append((span.scheduled, span.first_target, rows))
    return out
