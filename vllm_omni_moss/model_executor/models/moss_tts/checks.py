# SPDX-License-Identifier: Apache-2.0
"""The one integer check the package's arguments share: a count is an ``int`` (never a ``bool``) at least some minimum."""

from __future__ import annotations

__all__ = ["check_count", "is_count"]


def is_count(value, minimum: int = 0) -> bool:
    """Whether ``value`` is an ``int`` that is not a ``bool`` and is ``>= minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_count(value, name: str, minimum: int = 0) -> int:
    """``value`` if :func:`is_count`.

    Raises:
        ValueError: ``"{name} must be an integer >= {minimum}, got {value!r}"``.
    """
    if not is_count(value, minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
