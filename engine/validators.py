"""attrs validators for numeric fields, shared by every layer's values.

Each raises ``ValueError`` naming the field. A value of the wrong type fails
the same way, so a string or ``None`` where a number belongs is named too,
and NaN is neither positive nor non-negative.
"""

from __future__ import annotations

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
