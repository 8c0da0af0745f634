"""Follow-up rows: a speculating request scheduled while its previous step is still in flight.

Under an overlapped executor the host schedules step N+1 before it has read step N (reference/
deepinfer.md §2.3–2.4, the zero-overhead scheduler). A speculating request whose row of step N verified
drafts will have emitted 1 + a tokens, a unknown on the host; and its next drafts were made on the
device right after step N (``engine/drafting.py``). So the scheduler gives it a *follow-up row* in N+1
laid out as if step N accepted no draft — its last token at the position after N's input, then ``g``
draft rows — on blocks reserved for the worst case (every draft of N accepted), and the device fixes
the row up from step N's results before the forward (``FollowUps.apply``, stream-ordered, no host
read):

- positions and cache slots move by a (the slots through the request's block table), and so does its
  KV length;
- its input token is N's final emitted token, its draft rows the drafts made after N, and the
  verification takes those drafts: as many as were drafted, the request may still use (its room less
  a) and the host granted (``g``; rows past them verify nothing and are rolled back like rejected
  drafts);
- the RNG counter of its draws moves by a, so every draw is the one the synchronous executor makes.

The host learns a, the drafts and their confidences when it processes step N, and moves its own view
of the row then (``EngineCore.process``). With the ``fixed`` plan a follow-up row therefore verifies
exactly the drafts the synchronous executor's row would, and emits the same tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.drafting import StepTokens
from deepinfer.interfaces import ForwardContext
from deepinfer.model.transfer import to_device_many
from deepinfer.sampling.sampler import SamplingBatch
from deepinfer.sampling.verify import VerifyBatch

if TYPE_CHECKING:
    from deepinfer.engine.speculation import DeviceProposal


@dataclass(frozen=True)
class FollowUps:
    """A step's follow-up rows, as the host knows them when it prepares the step. Per row: ``token_rows``
    its first token row, ``requests`` its index among the step's rows (its KV length and block table),
    ``samplers`` among the step's sampling rows, ``random`` among the sampling batch's random rows (−1:
    greedy), ``sources`` its sampling row in the previous step, ``proposal_rows`` its row of the previous
    step's proposal (−1: it did not draft), ``drafts`` the draft rows it brings (``g``) and ``rooms`` the
    drafts it may still use if the previous step accepted none of its drafts."""

    token_rows: list[int]
    requests: list[int]
    samplers: list[int]
    random: list[int]
    sources: list[int]
    proposal_rows: list[int]
    drafts: list[int]
    rooms: list[int]

    def apply(self, previous: StepTokens, proposal: DeviceProposal | None, input_ids: torch.Tensor,
              ctx: ForwardContext, sampling: SamplingBatch | None, verify: VerifyBatch | None,
              num_samplers: int, vocab_size: int) -> tuple[VerifyBatch | None, torch.Tensor]:
        """Fix the rows up on the device from the previous step's tokens and proposal (see the module
        docstring). Returns the step's verification inputs with the follow-ups' drafts in place (a new
        batch when draft distributions had to be added), and how far each of the step's ``num_samplers``
        sampling rows moved ``[S]`` (0 but for follow-ups: the drafting after the step starts there)."""
        dev = input_ids.device
        k = verify.drafts.shape[1] if verify is not None else 0
        lists = self._indices(dev, ctx.block_tables.shape[1], previous.emitted.shape[1], proposal, k)
        accepted = previous.num_accepted.index_select(0, lists["sources"])
        moved = torch.zeros(num_samplers, dtype=torch.int64, device=dev).index_copy_(0, lists["samplers"], accepted)
        return self._fix(lists, previous, proposal, accepted, input_ids, ctx, sampling, verify, vocab_size), moved

    def _indices(self, device: torch.device, table_width: int, emitted_width: int, proposal: DeviceProposal | None,
                 k: int) -> dict[str, torch.Tensor]:
        """Every host-built index list of the fix-up on ``device``, in one copy (never waiting for it): the
        shapes (``table_width`` of the step's block tables, ``emitted_width`` of the previous step's tokens,
        the proposal's and ``k`` the verified drafts' width) are host facts, so flat indices are built here
        and the device gathers each quantity with one op."""
        counts = [1 + g for g in self.drafts]
        random = [(i, r) for i, r in enumerate(self.random) if r >= 0]
        draft_rows = [(i, j) for i, g in enumerate(self.drafts) for j in range(g)]
        owner = [i for i, n in enumerate(counts) for _ in range(n)]
        lists = {
            "sources": self.sources, "samplers": self.samplers, "requests": self.requests,
            "token_rows": self.token_rows, "rooms": self.rooms,
            "owner": owner,
            "rows": [first + j for first, n in zip(self.token_rows, counts, strict=True) for j in range(n)],
            # Each row's block table, flat: the table of its request starts at request · table width.
            "table_base": [self.requests[i] * table_width for i in owner],
            # The previous step's final token of each row's source, flat: source · width + accepted.
            "last_at": [source * emitted_width for source in self.sources],
            "random_rows": [r for _, r in random], "random_of": [i for i, _ in random],
            "draft_at": [self.token_rows[i] + 1 + j for i, j in draft_rows],
            "draft_from": [i * k + j for i, j in draft_rows],
        }
        if proposal is not None and k:
            # Draft j of each follow-up, flat in the proposal's tokens; the index past them (−1 there) where the
            # row did not draft, or past its drafts or its grant.
            rows, width = proposal.tokens.shape
            usable = min(k, width)
            lists["proposal_at"] = [p * width + j if p >= 0 and j < min(g, usable) else rows * width
                                    for p, g in zip(self.proposal_rows, self.drafts, strict=True) for j in range(k)]
            drafted = [i for i, row in enumerate(self.proposal_rows) if row >= 0]
            lists["drafted"] = drafted
            lists["proposal_rows"] = [self.proposal_rows[i] for i in drafted]
        return dict(zip(lists, to_device_many([(v, torch.int64) for v in lists.values()], device), strict=True))

    def _fix(self, lists: dict[str, torch.Tensor], previous: StepTokens, proposal: DeviceProposal | None,
             accepted: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext, sampling: SamplingBatch | None,
             verify: VerifyBatch | None, vocab_size: int) -> VerifyBatch | None:
        dev = input_ids.device
        rows, requests = lists["rows"], lists["requests"]
        # Rows are distinct and so are requests: index_copy_ / index_add_ do what ``x[i] += y`` would.
        positions = ctx.positions.index_select(0, rows) + accepted.index_select(0, lists["owner"])
        ctx.positions.index_copy_(0, rows, positions)
        ctx.seq_lens.index_add_(0, requests, accepted)
        bs = ctx.block_size
        blocks = ctx.block_tables.reshape(-1).index_select(0, lists["table_base"] + positions // bs)
        ctx.slot_mapping.index_copy_(0, rows, blocks * bs + positions % bs)
        last = previous.emitted.reshape(-1).index_select(0, lists["last_at"] + accepted)
        input_ids.index_copy_(0, lists["token_rows"], last)
        if sampling is not None and any(r >= 0 for r in self.random):
            sampling.positions.index_add_(0, lists["random_rows"], accepted.index_select(0, lists["random_of"]))
        if verify is None:
            return None
        samplers = lists["samplers"]
        verify.base.index_add_(0, samplers, accepted)
        if not any(self.drafts) or proposal is None:
            verify.num_drafts.index_fill_(0, samplers, 0)
            return verify
        k = verify.drafts.shape[1]
        width = min(k, proposal.tokens.shape[1])
        source = torch.cat([proposal.tokens.reshape(-1), proposal.tokens.new_full((1,), -1)])
        drafts = source.index_select(0, lists["proposal_at"]).view(len(self.drafts), k)
        # A proposal's drafts are a prefix of its row (−1 after: ``DeviceProposal``), and so is the grant.
        usable = (drafts >= 0).sum(dim=1)
        room = (lists["rooms"] - accepted).clamp(min=0)
        verify.num_drafts.index_copy_(0, samplers, torch.minimum(usable, room))
        verify.drafts.index_copy_(0, samplers, drafts)
        draft_ids = drafts.reshape(-1).index_select(0, lists["draft_from"]).clamp(min=0)
        input_ids.index_copy_(0, lists["draft_at"], draft_ids)
        if proposal.probs is None:
            return verify
        cols = torch.arange(k, device=dev)
        drafted_index, source_rows = lists["drafted"], lists["proposal_rows"]
        probs = verify.draft_probs
        if probs is None:  # the host's drafts were one-hot: write their distributions out
            probs = torch.zeros(verify.drafts.shape[0], k, vocab_size, dtype=torch.float32, device=dev)
            host = (cols < verify.num_drafts.unsqueeze(1)) & (verify.drafts >= 0)
            probs.scatter_(-1, verify.drafts.clamp(min=0).unsqueeze(-1), host.unsqueeze(-1).to(torch.float32))
            verify = dataclasses.replace(verify, draft_probs=probs)
        probs[samplers.index_select(0, drafted_index), :width] = proposal.probs.index_select(
            0, source_rows)[:, :width].to(probs.dtype)
        return verify
