"""A small trio helper shared by the server loop and the model host."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def cancel_after(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once ``wait()`` returns.

    Started in a nursery, several of these race: the first awaited thing to
    finish (an event's ``wait``, a shutdown trigger) ends the scope.
    """
    await wait()
    scope.cancel()
