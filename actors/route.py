"""``Route``: one request the scheduler actor holds, and where its outputs go.

A route is the send end of the request's output channel (the scheduler owns
it from the moment it takes the request) and the state of its delivery.
``Delivery`` (delivery.py) opens, feeds and closes routes; ``Deadlines``
(deadlines.py) watches their deadlines. Both read ``closed``: a closed route
is over, and whatever still points at it is stale.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from trioserve.engine.core.sequence import FinishReason


@attrs.define(eq=False)
class Route:
    """Where one request's outputs go, and its delivery state."""

    request_id: str
    outputs: trio.MemorySendChannel[Any]
    num_completions: int
    num_prompt_tokens: int = 0
    reasons: dict[int, FinishReason] = attrs.field(factory=dict)  # finished completions
    pause_pending: bool = False  # Paused sent, preemption not applied yet
    paused: bool = False
    broken: bool = False  # the reader closed its end
    closed: bool = False  # delivery is over; the scheduler has let the request go
    has_deadline: bool = False  # an entry of the deadline heap points here (kept by Deadlines)
