"""``TrioserveApp``: quart-trio's app with its HTTP connection fixed to let
hypercorn finish each response's bookkeeping.

After the last body message of a response, hypercorn (0.18) does its
connection bookkeeping inside that same ``send`` call: it tells the app
``http.disconnect`` (the request is over), then either closes the connection
(``Connection: close``, HTTP/1.0, an unread request body) or starts the
keep-alive idle timer. quart-trio's connection cancels its nursery the
moment it receives ``http.disconnect``, and the ``send`` still running in
that nursery is cancelled with it, at hypercorn's next checkpoint: the close
or the timer never happens, and the socket stays open with no timer to end
it. A disconnect received once the last body message is on its way is this
bookkeeping, not a client gone, so it no longer cancels anything; the
handler is about to return by itself.
"""

from __future__ import annotations

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, ASGISendEvent, HTTPScope
from quart import Quart
from quart.asgi import ASGIHTTPConnection
from quart.wrappers import Request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

import trio


class HTTPConnection(TrioASGIHTTPConnection):
    """One HTTP request of a ``TrioserveApp``."""

    def __init__(self, app: Quart, scope: HTTPScope) -> None:
        super().__init__(app, scope)
        self._response_ending = False

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        async def send_noting_the_end(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._response_ending = True
            await send(message)

        await super().__call__(receive, send_noting_the_end)

    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Request, receive: ASGIReceiveCallable
    ) -> None:
        await ASGIHTTPConnection.handle_messages(self, request, receive)  # returns at http.disconnect
        if not self._response_ending:  # the client went away mid-request: stop its handler
            nursery.cancel_scope.cancel()


class TrioserveApp(QuartTrio):
    """The app class ``create_app`` makes (see the module's docstring)."""

    asgi_http_class = HTTPConnection
