"""What a rank sends the driver back for a ``step`` (pickled; defined outside ``worker.py``, which runs
as ``__main__`` in the rank processes)."""

from __future__ import annotations

from typing import NamedTuple

from deepinfer.interfaces import RankLoad
from deepinfer.outputs import RequestOutput, TokenLogprobs


class TokenDelta(NamedTuple):
    """What an unfinished request committed in one streaming step: its output tokens past those sent
    before, their logprob rows (None unless asked for), and with the first delta the prompt's logprobs."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[TokenLogprobs | None] | None


class StepReply(NamedTuple):
    """A rank's answer to ``step``: whole outputs of the requests that finished, deltas of those that
    committed tokens and go on (streaming only), the rank's load, and how many requests the driver had
    routed there when it was measured (the load counts those; the driver adds any routed since)."""

    finished: list[RequestOutput]
    deltas: list[TokenDelta]
    load: RankLoad
    requests_received: int
