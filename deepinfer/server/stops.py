"""Incremental stop-string hold-back for streaming (one Knuth–Morris–Pratt matcher per stop string).

While a request streams, text that could still turn out to start a stop string must not be sent yet:
the engine cuts the final text at the first stop string, and a streamed prefix of it cannot be taken
back. How much to hold is the length of the longest suffix of the text that is a prefix of some stop
string. Checking every stop against the tail of the whole text on every chunk costs stops × length per
chunk on the event loop; a KMP matcher keeps, per stop, the length of its longest prefix that the text
ends with, so a chunk costs its new characters × the number of stops (bounded by the server's limits,
``protocol.MAX_STOP_STRINGS``). Building costs the stops' total length in plain integer steps, cheap
enough for the event loop. (An Aho–Corasick automaton would make a chunk independent of the number of
stops, but its trie of up to 64 × 512 nodes took ~0.15 s of pure Python to build, which holds the GIL.)
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.structured.trigger import kmp_failure


class StopHoldBack:
    """Feed the stable text of a stream as it grows; ``advance`` says how many of its last characters to
    keep back (the longest suffix that is a prefix of a stop string). If the already fed prefix of the
    text changes (detokenization rarely rewrites earlier text), the new text is fed from the start."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._pi = [kmp_failure(s) for s in self._stops]
        self._matched = [0] * len(self._stops)  # per stop: the longest prefix of it the fed text ends with
        self._fed = ""
        self.chars_fed = 0  # characters run through the matchers (what a chunk costs; for tests)

    def advance(self, text: str) -> int:
        """Take ``text`` (the stream's stable text so far, which normally extends the previous one) and
        return how many of its last characters to hold back."""
        if not text.startswith(self._fed):
            self._matched = [0] * len(self._stops)
            self._fed = ""
        new = text[len(self._fed):]
        for j, (stop, pi) in enumerate(zip(self._stops, self._pi, strict=True)):
            k = self._matched[j]
            for ch in new:
                if k == len(stop):  # a whole stop string matched: continue from its longest border
                    k = pi[k - 1]
                while k and stop[k] != ch:
                    k = pi[k - 1]
                if stop[k] == ch:
                    k += 1
            self._matched[j] = k
        self.chars_fed += len(new)
        self._fed = text
        return max(self._matched, default=0)
