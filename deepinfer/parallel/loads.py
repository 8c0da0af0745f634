"""The driver's view of each rank's load for the ``RequestRouter``: what the rank last reported with a
step reply, plus the requests routed there that the report does not count yet. Ranks step on their own
loops, so a reply can be measured before a request already sent to that rank arrived."""

from __future__ import annotations

from collections import deque

from deepinfer.interfaces import RankLoad


class RankLoads:
    """Per rank: the last reported ``RankLoad`` plus the unreported routed requests (their tokens and
    ``ceil(tokens / block_size)`` KV blocks each)."""

    def __init__(self, world: int, block_size: int) -> None:
        self.block_size = block_size
        self._reported = [RankLoad(r, 0, 0) for r in range(world)]
        self.routed = [0] * world  # requests routed to each rank so far
        self._unreported: list[deque[tuple[int, int]]] = [deque() for _ in range(world)]  # (number, tokens)

    def routed_to(self, rank: int, num_tokens: int) -> None:
        """A request of ``num_tokens`` tokens was routed to ``rank``."""
        self.routed[rank] += 1
        self._unreported[rank].append((self.routed[rank], num_tokens))

    def reported(self, load: RankLoad, requests_received: int) -> None:
        """``load`` measured on its rank once the first ``requests_received`` requests routed there had
        arrived."""
        unreported = self._unreported[load.rank]
        while unreported and unreported[0][0] <= requests_received:
            unreported.popleft()
        self._reported[load.rank] = load

    def current(self) -> list[RankLoad]:
        """Every rank's load as the router sees it."""
        loads = []
        for load, unreported in zip(self._reported, self._unreported, strict=True):
            tokens = sum(n for _, n in unreported)
            blocks = sum(-(-n // self.block_size) for _, n in unreported)
            loads.append(RankLoad(load.rank, load.num_requests + len(unreported), load.num_tokens + tokens,
                                  load.num_kv_blocks + blocks))
        return loads
