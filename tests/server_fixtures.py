"""Real servers on free loopback ports, for the HTTP tests.

``serving(app)`` runs a server inside the calling trio test (its nursery),
for tests that need a server of their own. ``server_in_thread(app)`` runs
one in a thread with its own trio loop, so a module-scoped fixture can share
it between tests, sync ones included (the sync openai client blocks).
Both bind 127.0.0.1 port 0 and return only once the engines serve.
"""

from __future__ import annotations

import functools
import json
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import httpx
import trio
from quart_trio import QuartTrio

from trioserve.bench import scrape as server_scrape
from trioserve.engine.config import EngineConfig
from trioserve.web.app import app_host
from trioserve.web.serve import hypercorn_config, serve
from trioserve.web.settings import ServerConfig

MODEL = "SmolLM2-135M-Instruct"
# Small enough for two cores: 182 blocks of 16 tokens, 512-token contexts.
SMALL_ENGINE = dict(kv_cache_memory=128 << 20, max_model_len=512, max_num_seqs=64, max_num_batched_tokens=1024)
STARTUP_TIMEOUT = 120.0


def server_config(*, engine: dict[str, Any] | None = None, **server: Any) -> ServerConfig:
    """A ServerConfig on ``SMALL_ENGINE`` (updated by ``engine``)."""
    server.setdefault("shutdown_timeout", 5.0)
    return ServerConfig(engine=EngineConfig(**{**SMALL_ENGINE, **(engine or {})}), **server)


@attrs.frozen
class Server:
    url: str
    app: QuartTrio
    token: trio.lowlevel.TrioToken | None = None  # the server's trio loop

    @property
    def host(self):
        return app_host(self.app)

    def run_sync(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the server's trio loop, from another thread
        (``engine.statistics()`` of a server in a thread, say)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)


@asynccontextmanager
async def serving(app: QuartTrio, *, wait_ready: bool = True, **hypercorn_options: Any) -> AsyncIterator[Server]:
    """Serve ``app`` in this trio run until the block ends, then shut it
    down gracefully. ``hypercorn_options`` override hypercorn's settings."""
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, app_host(app).config)
    for name, value in hypercorn_options.items():
        setattr(config, name, value)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, app, config, shutdown_trigger=stop.wait))
        if wait_ready:
            with trio.fail_after(STARTUP_TIMEOUT):
                await app_host(app).wait_ready()
        try:
            yield Server(binds[0], app, trio.lowlevel.current_trio_token())
        finally:
            stop.set()


@contextmanager
def server_in_thread(app: QuartTrio) -> Iterator[Server]:
    """Serve ``app`` from a thread running its own trio loop."""
    handoff: queue.Queue[Any] = queue.Queue()

    async def main() -> None:
        async with serving(app) as server:
            stop = trio.Event()
            handoff.put((server, trio.lowlevel.current_trio_token(), stop))
            await stop.wait()

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # hand the failure to the test thread
            handoff.put(exc)

    thread = threading.Thread(target=thread_main, name="test-server", daemon=True)
    thread.start()
    item = handoff.get(timeout=STARTUP_TIMEOUT)
    if isinstance(item, BaseException):
        raise item
    server, token, stop = item
    try:
        yield server
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the test server did not shut down"
        if not handoff.empty():
            raise handoff.get()


# -- reading responses ---------------------------------------------------------


def parse_sse(raw: bytes) -> list[Any]:
    """Split an SSE body into its events' data (JSON-decoded, or ``"[DONE]"``),
    checking the framing: every event is one ``data: `` line and a blank line."""
    text = raw.decode()
    assert text.endswith("\n\n"), f"the stream does not end with a blank line: {text[-80:]!r}"
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, f"bad SSE event {block!r}"
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def read_sse_lines(response: httpx.Response) -> AsyncIterator[Any]:
    """Events of a streaming httpx response as they arrive."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def metric_values(text: str, model: str = MODEL) -> dict[str, float]:
    """Samples of a Prometheus exposition for ``model`` (``trioserve.bench.scrape``)."""
    return server_scrape.metric_values(text, model)


async def scrape(client: httpx.AsyncClient, model: str = MODEL) -> dict[str, float]:
    return await server_scrape.scrape(client, model)


async def wait_idle(client: httpx.AsyncClient, model: str = MODEL, timeout: float = 10.0) -> dict[str, float]:
    """``trioserve.bench.scrape.wait_idle`` for the tests' model: no request
    runs or waits; the last scrape."""
    return await server_scrape.wait_idle(client, model, timeout=timeout)
