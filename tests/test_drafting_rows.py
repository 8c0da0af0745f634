"""``draft_inputs`` for a drafting that drafts for no request (every one paused) hands the drafter the same step
rows — hidden states, next tokens, context — as the full path gives it when a request drafts (issue 28)."""

from __future__ import annotations

import torch

from deepinfer.engine.drafting import DraftPlan, StepTokens, draft_inputs
from deepinfer.interfaces import ForwardContext


def _step() -> tuple[ForwardContext, torch.Tensor, torch.Tensor, StepTokens]:
    """A step of 7 rows: a 3-token prefill chunk (request 0, samples nothing), a decode row (request 1) and a
    verification row of 2 drafts (request 2: 3 rows), plus one padding row."""
    ctx = ForwardContext(positions=torch.tensor([0, 1, 2, 9, 4, 5, 6, 0]),
                         slot_mapping=torch.tensor([16, 17, 18, 41, 68, 69, 70, 0]),
                         query_start_loc=torch.tensor([0, 3, 4, 7], dtype=torch.int32),
                         seq_lens=torch.tensor([3, 10, 7]), block_tables=torch.tensor([[1, 0], [2, 0], [4, 0]]),
                         num_decodes=0, query_start_loc_host=[0, 3, 4, 7], seq_lens_host=[3, 10, 7], block_size=16,
                         backends={})
    input_ids = torch.tensor([5, 6, 7, 30, 40, 41, 42, 0])
    hidden = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    # sampling rows: request 1 (one token), request 2 (accepted 1 of its 2 drafts)
    tokens = StepTokens(emitted=torch.tensor([[31, -1, -1], [41, 50, -1]]), num_accepted=torch.tensor([0, 1]))
    return ctx, input_ids, hidden, tokens


def _plan(drafting: bool) -> DraftPlan:
    n = 2 if drafting else 0  # the two sampling rows draft, or neither does (both paused)
    return DraftPlan(samplers=[0, 1][:n], request_ids=["b", "c"][:n], last_rows=[3, 4][:n], positions=[10, 5][:n],
                     rooms=[4, 4][:n], coverage=[32, 16][:n], tables=[[2, 0], [4, 0]][:n], seeds=[0, 0][:n],
                     temperatures=[0.0, 0.0][:n], state_slots=None, next_tokens=[6, 7, 8, 0, 41, 42, 0],
                     emitted_rows=[3, 4, 5, 6], emitted_from=[(0, 0), (1, 0), (1, 1), (1, 2)])


def test_a_drafting_for_no_request_gets_the_rows_the_full_path_gives():
    ctx, input_ids, hidden, tokens = _step()
    kw = {"k": 2, "input_ids": input_ids, "ctx": ctx, "hidden": hidden, "token_cache": None, "block_size": 16,
          "exact_host_lists": lambda c: None}
    full, _, _ = draft_inputs(_plan(True), tokens, **kw)
    rows_only, _, caps = draft_inputs(_plan(False), tokens, **kw)
    assert full.rows is not None and rows_only.rows is not None
    assert torch.equal(rows_only.rows.next_tokens, full.rows.next_tokens)
    assert rows_only.rows.next_tokens.tolist() == [6, 7, 8, 31, 41, 50, 0, 0]  # emitted tokens written at their rows
    assert rows_only.rows.hidden is hidden and torch.equal(rows_only.rows.ctx.slot_mapping, ctx.slot_mapping)
    assert rows_only.last_tokens.shape == (0,) and caps.shape == (0,) and rows_only.rows.last_rows.shape == (0,)
