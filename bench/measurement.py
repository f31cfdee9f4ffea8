"""What the client measured of one request: a value that ``client`` makes
and ``metrics`` summarizes."""

from __future__ import annotations

import attrs


@attrs.frozen
class RequestMeasurement:
    """What the client measured of one request: whether it succeeded, its
    lengths and timings. Times are in seconds; ``start_time`` is on trio's
    clock."""

    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    itl: tuple[float, ...] = ()
    e2el: float = 0.0
    start_time: float = 0.0
    error: str = ""
    generated_text: str = ""
