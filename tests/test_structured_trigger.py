"""Grammars that start after a trigger token sequence, with a bound token that forces it
(``so_args`` ``trigger_token_ids`` / ``bound_token_id``; structured/trigger.py), on a fake grammar."""

from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.structured.spec import parse_spec
from deepinfer.structured.trigger import TriggeredMatcher, kmp_failure

V = 64


class DigitsThenStop:
    """A stand-in for ``TokenMatcher``: the grammar ``[1-9]{2} STOP`` over token ids (digits are ids 1-9,
    STOP is 0), with the same accept / rollback / mask interface."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def num_accepted(self) -> int:
        return len(self.tokens)

    def _allowed(self) -> set[int]:
        if len(self.tokens) < 2:
            return set(range(1, 10))
        return {0} if len(self.tokens) == 2 else set()

    def accept(self, token: int) -> bool:
        if token not in self._allowed():
            return False
        self.tokens.append(token)
        return True

    def rollback(self, k: int) -> None:
        assert 0 <= k <= len(self.tokens)
        del self.tokens[len(self.tokens) - k:]

    def is_terminated(self) -> bool:
        return self.tokens[-1:] == [0] and len(self.tokens) == 3

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for t in self._allowed():
            bitmask[row, t // 32] |= 1 << (t % 32)


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return {t for t in range(V) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}


def test_kmp_failure():
    assert kmp_failure([5, 5, 7, 5, 5, 5]) == [0, 1, 0, 1, 2, 2]


def test_free_until_the_trigger_then_the_grammar():
    m = TriggeredMatcher(DigitsThenStop(), trigger=[40, 40, 41], bound=None, max_rollback=8)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    # "40 40 40 41": the overlapping partial match is kept (KMP), so the trigger completes here
    for token in (33, 40, 40, 40):
        m.fill_mask(bitmask, 0)
        assert allowed(bitmask, 0) == set(range(V))  # free generation
        assert m.accept(token)
    assert m.pending and m.accept(41) and not m.pending
    m.fill_mask(bitmask, 0)
    assert allowed(bitmask, 0) == set(range(1, 10))
    assert not m.accept(50) and m.num_accepted == 5  # refused by the grammar, state unchanged
    assert m.advance([3, 4, 0]) == 3 and m.is_terminated()
    m.rollback(4)  # back across the trigger's last token: free again, with 2 of 3 trigger tokens matched
    assert m.pending and m.progress == 2 and m.inner.tokens == [] and m.num_accepted == 4


def test_the_bound_token_forces_the_rest_of_the_trigger():
    m = TriggeredMatcher(DigitsThenStop(), trigger=[40, 41, 42], bound=60, max_rollback=8)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    # 40 matches the trigger's first token; the bound 60 then breaks that match and fires: the whole
    # trigger is forced from its first token
    assert m.advance([40, 60]) == 2
    assert m.bound_fired and m.progress == 0
    m.fill_mask(bitmask, 0)
    assert allowed(bitmask, 0) == {40}
    assert not m.accept(41)  # only the expected trigger token
    # draft masks: after "40" only 41, after "40 41" only 42, and the matcher ends where it began
    assert m.fill_draft_masks([40, 41], bitmask, 0) == 3
    assert [allowed(bitmask, r) for r in range(3)] == [{40}, {41}, {42}]
    assert m.num_accepted == 2 and m.progress == 0
    assert m.advance([40, 41, 42, 7]) == 4 and m.inner.tokens == [7]
    m.rollback(5)  # undo everything up to before the bound token
    assert not m.bound_fired and m.progress == 1


def test_so_args_form():
    spec = parse_spec(None, {"schema_type": "regex", "schema": "[0-9]+", "trigger_token_ids": [3, 4],
                             "bound_token_id": 0})
    assert spec.trigger == (3, 4) and spec.bound == 0
    assert spec.key == parse_spec(None, {"schema_type": "regex", "schema": "[0-9]+"}).key  # one compilation
    for bad, match in [({"trigger_token_ids": [1, -1]}, "trigger_token_ids"),
                       ({"trigger_token_ids": 3}, "trigger_token_ids"),
                       ({"bound_token_id": 5}, "needs a non-empty trigger_token_ids"),
                       ({"trigger_token_ids": [1], "bound_token_id": [2]}, "bound_token_id"),
                       ({"trigger": [1]}, "so_args must be")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(so_args={"schema_type": "regex", "schema": "a", **bad})
