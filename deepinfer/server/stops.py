"""Incremental stop-string hold-back for streaming (an Aho–Corasick automaton over the stop strings).

While a request streams, text that could still turn out to start a stop string must not be sent yet:
the engine cuts the final text at the first stop string, and a streamed prefix of it cannot be taken
back. How much to hold is the length of the longest suffix of the text that is a prefix of some stop
string. Checking every stop against the tail of the whole text on every chunk costs stops × length per
chunk on the event loop; the automaton keeps that suffix as its state, so each chunk costs only its new
characters, however many stop strings there are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopHoldBack:
    """Feed the stable text of a stream as it grows; ``hold`` is how many of its last characters to keep
    back (the longest suffix that is a prefix of a stop string). Building costs the total length of the
    stop strings; ``advance`` costs the characters it is given (plus a re-feed if the text's already fed
    prefix changed, which detokenization rarely does)."""

    def __init__(self, stops: Sequence[str]) -> None:
        # Trie nodes: goto[node] maps a character to a child, depth[node] is the prefix length it spells.
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                node = nxt
        self._fail = [0] * len(self._goto)
        order = deque(self._goto[0].values())  # breadth first: a node's failure link is set before its children's
        while order:
            node = order.popleft()
            for ch, child in self._goto[node].items():
                order.append(child)
                self._fail[child] = self._next(self._fail[node], ch)
        self._state = 0
        self._fed = ""
        self.chars_fed = 0  # characters run through the automaton (what a chunk costs; for tests)

    def _next(self, node: int, ch: str) -> int:
        """The state after ``ch`` from ``node``: the longest trie prefix that is a suffix of (text + ch)."""
        while True:
            child = self._goto[node].get(ch)
            if child is not None:
                return child
            if node == 0:
                return 0
            node = self._fail[node]

    def advance(self, text: str) -> int:
        """Take ``text`` (the stream's stable text so far, which normally extends the previous one) and
        return how many of its last characters to hold back."""
        if not text.startswith(self._fed):  # the fed prefix changed: start over on the new text
            self._state, self._fed = 0, ""
        state = self._state
        for ch in text[len(self._fed):]:
            state = self._next(state, ch)
        self.chars_fed += len(text) - len(self._fed)
        self._state, self._fed = state, text
        return self._depth[state]
