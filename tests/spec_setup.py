"""Set-up shared by the speculative-decoding tests (the spec_decode and scheduling plugins' suites): the
plugin's config section, prompts of which half repeat themselves, oracle-drafter files, and MTP drafting
steered onto a known continuation."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from deepinfer_spec_decode.mtp import MTPDrafter
from deepinfer_spec_decode.oracle import OracleDrafter

from deepinfer.interfaces import DraftInputs, DraftProposal


def spec_plugins(drafter: str, plan: str, **extra) -> dict:
    """The ``plugins`` mapping that turns speculation on with ``drafter`` and ``plan`` (4 drafts a step
    unless ``extra`` says otherwise)."""
    return {"spec_decode": {"enabled": True, "drafter": drafter, "plan": plan, "max_draft": 4, **extra}}


def repeating_prompts(n: int, seed: int, vocab: int = 256, low: int = 0) -> list[list[int]]:
    """``n`` random prompts of 3 to 39 ids in ``[low, vocab)``; every odd one ends by repeating its first
    ``4 + i`` ids, so the n-gram drafter finds matches."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        body = torch.randint(low, vocab, (int(torch.randint(3, 40, (), generator=gen)),), generator=gen).tolist()
        prompts.append(body + body[: 4 + i] if i % 2 else body)  # half of them repeat themselves: ngram hits
    return prompts


def write_oracle_file(folder: Path, prompts: list[list[int]], outputs: list[list[int]]) -> str:
    """An ``oracle`` drafter file in ``folder``: each prompt followed by its known continuation."""
    path = folder / "oracle.jsonl"
    path.write_text("\n".join(json.dumps({"token_ids": p + o}) for p, o in zip(prompts, outputs, strict=True)))
    return str(path)


class WithDrafts:
    """A request seen with the proposal its engine's speculator keeps for it (``Speculator.drafts_of``;
    drafts no longer live on the request): ``draft_tokens``, ``draft_confidence`` and
    ``draft_raw_confidence`` (lists, empty without a proposal) and ``draft_probs`` (``[n, V]``, or None
    for one-hot drafts or none); every other attribute is the request's own."""

    def __init__(self, request: Any, drafts: Any) -> None:
        self._request = request
        self.draft_tokens = list(drafts.tokens) if drafts is not None else []
        self.draft_confidence = list(drafts.confidence) if drafts is not None else []
        self.draft_raw_confidence = list(drafts.raw_confidence) if drafts is not None else []
        self.draft_probs = drafts.probs if drafts is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def running_with_drafts(engine: Any) -> list[WithDrafts]:
    """The engine's running requests, each with its current drafts (``WithDrafts``)."""
    return [WithDrafts(r, engine.speculator.drafts_of(r)) for r in engine.scheduler.running]


def known_drafts(monkeypatch: pytest.MonkeyPatch, sequences: list[list[int]], vocab: int,
                 drafter: type = MTPDrafter) -> None:
    """Let the ``drafter`` class run (an MTP or dspark drafter writes its cache rows) but propose the known
    greedy continuation of ``sequences`` with planted corruptions: some drafts are accepted, others rolled
    back."""
    inner = drafter.propose
    oracle = OracleDrafter(sequences, vocab, corruption=0.3, draft_probs=False)

    def propose(self: Any, inputs: DraftInputs) -> DraftProposal:
        proposal = inner(self, inputs)
        if inputs.last_tokens.numel() == 0:
            return proposal
        return dataclasses.replace(proposal, tokens=oracle.propose(inputs).tokens)

    monkeypatch.setattr(drafter, "propose", propose)


def check_drafts_every_step(engine: Any, k: int, reference: Callable[[list[int], int], tuple[list[int], list[float]]],
                            exact_tokens: bool = True) -> int:
    """Step ``engine`` to the end; after every step each running request that is decoding must hold
    ``reference(committed ids, n)``'s drafts (when ``exact_tokens``) and raw confidences, ``n`` = the
    drafts it may verify. Requests mid-prefill must hold none. Returns how many drafts sets were checked."""
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for req in running_with_drafts(engine):
            if req.num_computed_tokens != req.num_tokens - 1:
                assert not req.draft_tokens  # mid-prefill: nothing to draft yet
                continue
            want = min(k, req.params.max_tokens - req.num_output_tokens - 1)
            drafts, probs = reference(req.all_token_ids, want)
            assert len(req.draft_tokens) == want
            assert not exact_tokens or req.draft_tokens == drafts
            assert req.draft_raw_confidence == pytest.approx(probs, abs=1e-4)
            checked += 1
    return checked
