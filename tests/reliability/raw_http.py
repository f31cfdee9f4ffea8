"""HTTP/1.x by hand over a trio socket stream, for tests that need to send
what a client library would not (HTTP/1.0, half a body, nothing at all) and
to see exactly when the server closes the connection.

Every wait is bounded by ``FAIL_SAFE`` seconds: a server that never answers
or never closes fails the test instead of hanging it.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

FAIL_SAFE = 10.0


@attrs.frozen
class RawResponse:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.define
class RawConnection:
    """One client connection; ``buffer`` holds bytes received but not yet parsed."""

    stream: trio.SocketStream
    buffer: bytes = b""

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        parts = urlsplit(url)
        return cls(await trio.open_tcp_stream(parts.hostname, parts.port))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(1 << 16)
        self.buffer += data
        return bool(data)

    async def _read_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not await self._fill():
                raise EOFError(f"closed with {len(self.buffer)} of {size} bytes")
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    async def _read_line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if not await self._fill():
                raise EOFError("closed in the middle of a line")
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    async def response(self) -> RawResponse:
        """Read one whole response: by its length, its chunks, or until the server closes."""
        with trio.fail_after(FAIL_SAFE):
            status_line = await self._read_line()
            assert status_line.startswith(b"HTTP/1.1 "), status_line
            headers = {}
            while line := await self._read_line():
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if "content-length" in headers:
                body = await self._read_exactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding") == "chunked":
                body = b""
                while size := int(await self._read_line(), 16):
                    body += await self._read_exactly(size)
                    await self._read_exactly(2)
                await self._read_exactly(2)
            else:  # delimited by the close (HTTP/1.0)
                while await self._fill():
                    pass
                body, self.buffer = self.buffer, b""
        return RawResponse(int(status_line.split()[1]), headers, body)

    async def wait_closed(self) -> float:
        """Wait until the server closes the connection; return the seconds it
        took. Any byte received meanwhile fails the test."""
        start = trio.current_time()
        with trio.fail_after(FAIL_SAFE):
            while await self._fill():
                pass
        assert self.buffer == b"", f"unexpected bytes before the close: {self.buffer[:200]!r}"
        return trio.current_time() - start

    async def aclose(self) -> None:
        await self.stream.aclose()


def request(
    method: str, path: str, body: bytes | None = None, *, version: str = "1.1", headers: dict[str, str] | None = None
) -> bytes:
    """The bytes of a request; HTTP/1.1 gets a Host header, a body its length."""
    lines = [f"{method} {path} HTTP/{version}"]
    if version == "1.1":
        lines.append("Host: 127.0.0.1")
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")
