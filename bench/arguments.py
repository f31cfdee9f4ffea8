"""Argument types the ``trioserve bench`` commands share: each raises
``argparse.ArgumentTypeError``, so a bad value stops at parsing with a
message that names the flag."""

from __future__ import annotations

import argparse
import sys


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """``"1,8,16"`` -> ``[1, 8, 16]``: integers >= 1, in the order given."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 1,8,16, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """``"float32,bfloat16"`` -> ``["float32", "bfloat16"]``."""
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected names like a,b, got {text!r}")
    return values


def usage_error(command: str, message: str) -> int:
    """Print ``trioserve bench COMMAND: error: MESSAGE`` on stderr, as
    argparse does; the exit status 2."""
    print(f"trioserve bench {command}: error: {message}", file=sys.stderr)
    return 2
