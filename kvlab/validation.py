"""Argument checks shared by every layer: each raises a TypeError or ValueError naming the argument.

A check runs before anything changes, so a refused call leaves every structure as it was.
"""
from __future__ import annotations

import math
import numbers


def check_count(name: str, value, *, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (``True`` is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` must be ``True`` or ``False``: a truthy string such as ``"no"`` is refused."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_fraction(name: str, value, *, low: float = 0.0, high: float = 1.0) -> float:
    """A finite real number in ``(low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not low < value <= high:
        raise ValueError(f"{name} must be a number in ({low}, {high}], got {value!r}")
    return float(value)
