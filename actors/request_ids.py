"""The request ids in use, on the callers' side.

An id is in use while its request actor is open, and after that while the
engine still holds the request: until the scheduler lets a request go it
may still send outputs for it, so a new request under the same id would get
them. The scheduler says so with no call of its own: letting a request go
closes the send end of its output channel (``RequestActor.engine_holds``
reads that), as does the admission queue when it sheds a queued request.
"""

from __future__ import annotations

import attrs

from .request import RequestActor


@attrs.define
class RequestIds:
    """Open request actors by id, and the closed ones the engine still holds."""

    _open: dict[str, RequestActor] = attrs.field(init=False, factory=dict)
    _held: dict[str, RequestActor] = attrs.field(init=False, factory=dict)
    _sweep_at: int = attrs.field(init=False, default=16)

    def in_use(self, request_id: str) -> bool:
        held = self._held.get(request_id)
        if held is not None and not held.engine_holds:
            del self._held[request_id]
            held = None
        return held is not None or request_id in self._open

    def add(self, actor: RequestActor) -> None:
        """Reserve the id of a new, open actor."""
        assert not self.in_use(actor.request_id)
        self._open[actor.request_id] = actor

    def get(self, request_id: str) -> RequestActor | None:
        """The open actor of ``request_id``, if any."""
        return self._open.get(request_id)

    def closed(self, actor: RequestActor) -> None:
        """``actor`` has closed: its id stays in use while the engine holds
        its request (its ``Abort`` is on the way, or it is still queued)."""
        del self._open[actor.request_id]
        if actor.engine_holds:
            self._held[actor.request_id] = actor
            if len(self._held) >= self._sweep_at:
                self._sweep()  # amortized: at most once each time the held set doubles
                self._sweep_at = max(16, 2 * len(self._held))

    def _sweep(self) -> None:
        self._held = {request_id: actor for request_id, actor in self._held.items() if actor.engine_holds}

    def __len__(self) -> int:
        """Ids in use."""
        self._sweep()
        return len(self._open) + len(self._held)
