"""A grammar that starts after a trigger token sequence, with an optional bound token that forces it
(the reference's ``so_args`` ``trigger_token_ids`` / ``bound_token_id``).

Before the trigger has been generated, generation is free; the matcher follows how much of the
trigger the output ends with (a KMP automaton, so overlapping partial matches are found). Once the
trigger is complete, every further token goes to the grammar. If the bound token is generated while
the trigger is still pending, free generation ends: the rest of the trigger is forced token by token,
then the grammar follows (for example: after the end of a thinking block, a tool call must come).

``TriggeredMatcher`` has ``TokenMatcher``'s interface (``num_accepted`` counts every committed output
token, trigger and free ones included), so the step masks and speculative verification use it unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from deepinfer.structured.grammar import TokenMatcher


class _State(NamedTuple):
    """The trigger's state before one committed token, and whether that token went to the grammar."""

    progress: int
    bound_fired: bool
    to_grammar: bool


def kmp_failure(pattern: Sequence[int]) -> list[int]:
    """``failure[i]``: the length of the longest proper prefix of ``pattern[:i + 1]`` that is also its suffix."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        failure[i] = k
    return failure


class TriggeredMatcher:
    """``inner`` (the compiled grammar's matcher) applied after ``trigger``; see the module docstring.
    ``max_rollback`` bounds how many committed tokens can be rolled back (as ``TokenMatcher``'s)."""

    def __init__(self, inner: TokenMatcher, trigger: Sequence[int], bound: int | None, max_rollback: int) -> None:
        if not trigger and bound is not None:
            raise ValueError("so_args['bound_token_id'] needs a non-empty trigger_token_ids")
        self.inner = inner
        self.trigger = tuple(trigger)
        self.bound = bound
        self._failure = kmp_failure(self.trigger)
        self.progress = 0
        self.bound_fired = False
        self.num_accepted = 0
        self._history: deque[_State] = deque(maxlen=max(max_rollback, 1))

    @property
    def pending(self) -> bool:
        """The trigger has not been completed yet: the grammar is not active."""
        return self.progress < len(self.trigger)

    def accept(self, token: int) -> bool:
        """Commit one token; False (state unchanged) when it is not allowed (a forced trigger token
        other than the expected one, or a token the active grammar refuses)."""
        token = int(token)
        if not self.pending:
            if not self.inner.accept(token):
                return False
            self._history.append(_State(self.progress, self.bound_fired, True))
            self.num_accepted += 1
            return True
        before = _State(self.progress, self.bound_fired, False)
        if self.bound_fired:
            if token != self.trigger[self.progress]:
                return False
            self.progress += 1
        else:
            k = self.progress
            while k and token != self.trigger[k]:
                k = self._failure[k - 1]
            self.progress = k + 1 if token == self.trigger[k] else k
            if self.bound is not None and token == self.bound and self.pending:
                self.bound_fired = True
        self._history.append(before)
        self.num_accepted += 1
        return True

    def advance(self, tokens: Sequence[int]) -> int:
        """Accept ``tokens`` in order until one is refused; returns how many were accepted."""
        for i, token in enumerate(tokens):
            if not self.accept(token):
                return i
        return len(tokens)

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` committed tokens."""
        if k < 0 or k > len(self._history):
            raise ValueError(f"TriggeredMatcher.rollback: k={k} outside [0, {len(self._history)}] "
                             "(committed tokens, max_rollback)")
        if not k:
            return
        undone = [self._history.pop() for _ in range(k)]
        to_grammar = sum(s.to_grammar for s in undone)
        if to_grammar:
            self.inner.rollback(to_grammar)
        self.progress, self.bound_fired = undone[-1].progress, undone[-1].bound_fired
        self.num_accepted -= k

    def is_terminated(self) -> bool:
        """The active grammar accepted a stop token."""
        return not self.pending and self.inner.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into ``bitmask[row]``: any (free), the forced trigger token, or the grammar's."""
        if not self.pending:
            self.inner.fill_mask(bitmask, row)
        elif self.bound_fired:
            expected = self.trigger[self.progress]
            bitmask[row].zero_()
            word = expected >> 5
            bit = 1 << (expected & 31)
            # int32 words: bit 31 is the sign bit.
            bitmask[row, word] = bit - (1 << 32) if bit >= 1 << 31 else bit
        else:
            bitmask[row].fill_(-1)

    def fill_draft_masks(self, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
        """As ``TokenMatcher.fill_draft_masks``: rows ``first_row + j`` get the tokens allowed after the
        committed ones plus ``drafts[:j]``, up to the first refused draft; the matcher ends where it began."""
        self.fill_mask(bitmask, first_row)
        filled, taken = 1, 0
        for token in drafts:
            if not self.accept(token):
                break
            taken += 1
            if self.is_terminated():
                break
            self.fill_mask(bitmask, first_row + taken)
            filled += 1
        if taken:
            self.rollback(taken)
        return filled
