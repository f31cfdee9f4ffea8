"""The value types of the commands' options, and a recorder of the options added.

Each type turns an option's text into its value, or raises
``argparse.ArgumentTypeError`` with a message that says what was expected,
which argparse reports against the option's name.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def recording(parser: Any, actions: list[argparse.Action]) -> Callable[..., argparse.Action]:
    """``parser.add_argument`` (a parser's or an argument group's) that also
    appends each option it adds to ``actions``, so the options can be read
    back without argparse's internals."""

    def add(*args, **kwargs) -> argparse.Action:
        action = parser.add_argument(*args, **kwargs)
        actions.append(action)
        return action

    return add


def parse_memory(text: str | None) -> int | float | None:
    """``'2G'`` -> bytes, ``'0.5'`` -> a fraction, ``None`` -> None."""
    if text is None:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    value = float(text)
    return value if value <= 1.0 else int(value)


def seconds(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def count(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def watchdog_seconds(text: str) -> float:
    """Seconds > 0, or 0 for no watchdog."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no watchdog), got {text!r}")
    return value


def size_in_bytes(text: str) -> int:
    """A size >= 1 byte, with an optional K, M or G suffix."""
    try:
        value = parse_memory(text)
    except ValueError:
        value = None
    if not isinstance(value, int) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 1048576 or 1M, got {text!r}")
    return value


def fraction_or_off(text: str) -> float | None:
    """A fraction in (0, 1], or ``off``/``none`` for None."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] or 'off', got {text!r}")
    return value
