"""attrs validators for numeric fields, shared by every layer's values.

Each raises ``ValueError`` naming the field. A value of the wrong type fails
the same way, so a string or ``None`` where a number belongs is named too,
and NaN is neither positive nor non-negative.
"""

from __future__ import annotations

import math
from typing import Any

import attrs


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


def positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """The field must be a number > 0."""
    if not (_is_number(value) and value > 0):
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """The field must be a number >= 0."""
    if not (_is_number(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def optional_positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """The field must be ``None`` (unset) or a number > 0."""
    if value is not None:
        positive(instance, attribute, value)


def optional_positive_finite(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """The field must be ``None`` (unset) or a finite number > 0."""
    if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def optional_fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """The field must be ``None`` (off) or a number in (0, 1]."""
    if value is not None and not (_is_number(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{attribute.name} must be in (0, 1] or None (off), got {value!r}")


def integer_at_least(low: int) -> Any:
    """A validator: the field must be an integer (not a bool) >= ``low``."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{attribute.name} must be an integer >= {low}, got {value!r}")

    return check
