# SPDX-License-Identifier: Apache-2.0
"""The integer checks the package's arguments share: a count is an ``int`` (never a ``bool``) at least some
minimum; codes are a tensor of an integer dtype (never ``bool``)."""

from __future__ import annotations

import torch

__all__ = ["check_count", "is_count", "is_integer_dtype"]


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` hold integer codes: not floating point, not complex, not ``bool``."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


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
