"""What the client measured of one request: a value that ``client`` makes
and ``metrics`` summarizes."""

from __future__ import annotations

import attrs


@attrs.frozen
class RequestMeasurement:
    """What the client measured of one request: whether it succeeded, its
    lengths and timings. Times are in seconds; ``start_time`` is on trio's
    clock. Where the server predicted the request's TTFT at its door (its
    response's ``usage.slo``, issue #44), ``predicted_ttft`` is that
    prediction and ``server_ttft`` the TTFT the server measured, from the
    same arrival (the client's ``ttft`` adds the network and the parsing)."""

    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    itl: tuple[float, ...] = ()
    e2el: float = 0.0
    start_time: float = 0.0
    error: str = ""
    generated_text: str = ""
    predicted_ttft: float | None = None
    server_ttft: float | None = None
