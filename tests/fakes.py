"""Small stand-ins for engine objects, for unit tests of strategies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FakeRequest:
    """A ``SchedulableRequest``: what policies and routers see of a request."""

    request_id: str
    arrival_time: float
    priority: int = 0
    num_prompt_tokens: int = 10
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
