"""The responses ``POST /v1/responses`` keeps (``store``, true unless the
request says false): what ``GET`` and ``DELETE /v1/responses/{id}`` and a
later request's ``previous_response_id`` find.

The store is per server process and held by the host (web/host.py); it
is bounded: past ``capacity`` the least recently used response is
dropped (``--responses-store-size``), so a server that answers forever
holds a bounded number of them. A lookup counts as a use. Nothing is
written to disk: a restart forgets every response.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs

from trioserve.engine.validators import positive


@attrs.frozen
class StoredResponse:
    """One stored response: ``body`` as the client got it, and
    ``conversation``, the items a request continuing it starts from (its
    own input items after those of the responses it continued, then its
    output items; web/openai_responses.py's canonical shapes). Both are
    read only, never changed."""

    body: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]

    @property
    def id(self) -> str:
        return self.body["id"]


@attrs.frozen
class StoreStatistics:
    size: int
    capacity: int


@attrs.define
class ResponsesStore:
    """At most ``capacity`` responses by id, the least recently used
    dropped first."""

    capacity: int = attrs.field(validator=positive)
    _by_id: OrderedDict[str, StoredResponse] = attrs.field(factory=OrderedDict, init=False)

    def put(self, response: StoredResponse) -> None:
        self._by_id[response.id] = response
        self._by_id.move_to_end(response.id)
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The response of ``response_id`` (None: never stored, deleted,
        or dropped for newer ones)."""
        response = self._by_id.get(response_id)
        if response is not None:
            self._by_id.move_to_end(response_id)
        return response

    def delete(self, response_id: str) -> bool:
        """Forget ``response_id``; whether it was there."""
        return self._by_id.pop(response_id, None) is not None

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(len(self._by_id), self.capacity)
