"""Step rows: one request's share of a step as plain data, what the runner and ``structured/`` read.

The scheduler emits one ``StepRow`` per scheduled request (``SchedulerOutput.rows``), after it has
advanced the request optimistically (``Scheduler.schedule``). A row is a frozen copy of the values the
step needs: its input tokens, positions, block table, sampling settings and RNG counter, drafts, the
bounded-replay floors and the grammar handle. Nothing below the engine reads the engine's mutable
``Request`` (vLLM v1's ``SchedulerOutput`` is plain data for the same reason): the runner builds
tensors from rows, and the engine maps a row back to its request by ``request_id`` when it reads the
step's results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.interfaces import ReplayPlan
from deepinfer.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class StepRow:
    """One request's share of a step: compute positions ``[start, start + num_new_tokens)``.

    ``token_ids``: the input token of each of those positions — the request's tokens, then its
    ``drafts``; a token sampled by a step whose results the host has not read stands as ``PENDING``
    (−1), and ``pending_offset`` is the index of the first such token here (−1: none), which the
    device fills from that step's sampled tokens. ``block_table``: the request's blocks when scheduled.

    ``samples``: the row's logits give a new token, stored at ``token_slot`` of the request's tokens.
    ``epoch``: the request's epoch when scheduled (results of an older epoch are dropped). ``params``,
    ``seed`` and ``counter`` (the request's length with this step's sampled token: the RNG position
    of the row's first draw) fix every draw. ``num_prompt_tokens``; ``prompt_targets``: the prompt
    tokens scored by this row's prompt logprobs (positions ``start + 1``…; empty unless
    ``params.prompt_logprobs`` asks and the row reaches into the prompt).

    ``drafts``: tokens verified after the request's last token (speculative decoding), and
    ``draft_probs`` the drafter's distributions ``[k, V]`` of the request's proposal (None: one-hot).
    ``follows``: a follow-up row (``engine/followup.py``): the request's previous step is in flight, the
    row is laid out as if that step accepted no draft, and the device moves it by the accepted count
    and fills its input token and its ``device_drafts`` draft rows (drafted on the device after that
    step; ``drafts`` is then empty); ``room``: the drafts the request may still use if that step
    accepted none of its drafts.
    ``visibility_floor``: keys below it are invisible to sliding-window attention (bounded restore;
    0: none); ``truncation``: the YoCo prefill plan of this chunk (None: none). ``state_slot`` /
    ``write_floor``: the request's state slot and its shared-prefix length, for models with
    per-request state (None / 0 otherwise). ``grammar``: the request's grammar handle
    (``structured.grammar.RequestGrammar``; None without structured output).

    Logits processing (``sampling/penalties.py``; set only on sampling rows whose ``params`` process
    logits): ``prompt_token_ids`` and ``output_token_ids`` (the output tokens known on the host), from
    which the runner rebuilds the request's count slot when it is new or was preempted, and
    ``banned_eos`` (the tokens ``first_n_token_no_eos`` bans).
    """

    request_id: str
    start: int
    num_new_tokens: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    params: SamplingParams
    seed: int
    counter: int
    num_prompt_tokens: int
    samples: bool = False
    token_slot: int = -1
    epoch: int = 0
    pending_offset: int = -1
    prompt_targets: tuple[int, ...] = ()
    drafts: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None
    follows: bool = False
    device_drafts: int = 0
    room: int = 0
    visibility_floor: int = 0
    truncation: ReplayPlan | None = None
    state_slot: int | None = None
    write_floor: int = 0
    grammar: Any = None
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    banned_eos: frozenset[int] = frozenset()

    @property
    def draft_rows(self) -> int:
        """The rows after the request's last token that verify drafts (its host drafts, or a follow-up's)."""
        return len(self.drafts) + self.device_drafts

    @property
    def end(self) -> int:
        """One past the row's last position (the request's KV length after the step)."""
        return self.start + self.num_new_tokens

    @property
    def positions(self) -> range:
        """The positions the row computes."""
        return range(self.start, self.start + self.num_new_tokens)
