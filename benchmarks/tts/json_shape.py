# SPDX-License-Identifier: Apache-2.0
"""What a results JSON must hold, checked once where it is loaded: one error naming the key that is wrong.

A shape is one of:

* a :class:`Leaf` (``NUMBER``, ``INT``, ``STR``, ``BOOL``, ``ANY``): the value's type; ``null`` is refused
  unless the leaf is wrapped in :func:`maybe`;
* a ``dict``: an object holding each named key (a name ending in ``?`` may be absent), every key matching a
  :class:`Keys` pattern (``RUN_KEY``), and ``"*"``: every key not otherwise named; other keys are free;
* :class:`ListOf` (or ``[shape]``): a list of items of that shape;
* :func:`maybe` of a shape: that shape or ``null``;
* :class:`When`: one of two shapes, chosen by a test on the object (a field that decides what else it holds);
* a ``tuple`` of shapes: every one of them.

:func:`check` also refuses a non-finite number anywhere in the document (``NaN``, ``Infinity``, or a literal
too large for a float): Python's ``json`` reads them, but no table or limit means anything with one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ANY",
    "BOOL",
    "INT",
    "NUMBER",
    "RUN_KEY",
    "STR",
    "Keys",
    "Leaf",
    "ListOf",
    "ShapeError",
    "When",
    "check",
    "load",
    "maybe",
]


class ShapeError(ValueError):
    """``key`` (dotted, list items as ``[i]``; empty for the document itself) breaks its shape: ``problem``."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"{key or 'the top level'} {problem}")


@dataclass(frozen=True)
class Leaf:
    """A value of one kind: ``test`` accepts it, ``name`` says what was expected; ``null`` only if ``nullable``."""

    name: str
    test: Callable[[Any], bool]
    nullable: bool = False


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


NUMBER = Leaf("a number", _is_number)
INT = Leaf("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
STR = Leaf("a string", lambda v: isinstance(v, str))
BOOL = Leaf("true or false", lambda v: isinstance(v, bool))
ANY = Leaf("any value", lambda v: True, nullable=True)


@dataclass(frozen=True)
class Nullable:
    """``shape`` or ``null`` (:func:`maybe` of a shape other than a leaf)."""

    shape: Any


def maybe(shape: Any) -> Any:
    """``shape`` or ``null``."""
    if isinstance(shape, Leaf):
        return Leaf(shape.name + " or null", shape.test, nullable=True)
    return Nullable(shape)


@dataclass(frozen=True)
class Keys:
    """A dict-shape key standing for every key that matches ``pattern`` in full."""

    pattern: str

    def matches(self, key: str) -> bool:
        return re.fullmatch(self.pattern, key) is not None


#: The key of one run in ``arms.<arm>`` and ``details.<arm>`` of ``bench_codec_stage.py``: a concurrency
#: (``"64"``) or a request rate (``"rate=2.5"``); the other keys there are sweep lines (``max_streams_at_slo``).
RUN_KEY = Keys(r"[0-9]+|rate=[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?")


@dataclass(frozen=True)
class ListOf:
    item: Any
    min_items: int = 0


@dataclass(frozen=True)
class When:
    """``then`` for an object that ``test`` accepts, else ``otherwise``."""

    test: Callable[[dict], bool]
    then: Any
    otherwise: Any


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return repr(value)  # a number: the value itself says why it is not the one expected


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _finite(value: Any, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ShapeError(path, f"is {'NaN' if math.isnan(value) else 'infinite'}, expected a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            _finite(item, _join(path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _finite(item, _join(path, i))


def _object(value: Any, shape: dict, path: str) -> None:
    if not isinstance(value, dict):
        raise ShapeError(path, f"is {_kind(value)}, expected an object")
    named = {name.removesuffix("?") for name in shape if isinstance(name, str)}
    for name, sub in shape.items():
        if isinstance(name, Keys):
            for key in value:
                if name.matches(key):
                    _check(value[key], sub, _join(path, key))
        elif name == "*":
            for key in value:
                if key not in named and not any(isinstance(k, Keys) and k.matches(key) for k in shape):
                    _check(value[key], sub, _join(path, key))
        elif name.removesuffix("?") in value:
            _check(value[name.removesuffix("?")], sub, _join(path, name.removesuffix("?")))
        elif not name.endswith("?"):
            raise ShapeError(_join(path, name), "is missing")


def _check(value: Any, shape: Any, path: str) -> None:
    if isinstance(shape, Leaf):
        if value is None and not shape.nullable:
            raise ShapeError(path, f"is null, expected {shape.name}")
        if value is not None and not shape.test(value):
            raise ShapeError(path, f"is {_kind(value)}, expected {shape.name}")
    elif isinstance(shape, dict):
        _object(value, shape, path)
    elif isinstance(shape, list | ListOf):
        item, least = (shape[0], 0) if isinstance(shape, list) else (shape.item, shape.min_items)
        if not isinstance(value, list):
            raise ShapeError(path, f"is {_kind(value)}, expected a list")
        if len(value) < least:
            raise ShapeError(path, f"has {len(value)} items, expected at least {least}")
        for i, element in enumerate(value):
            _check(element, item, _join(path, i))
    elif isinstance(shape, tuple):
        for part in shape:
            _check(value, part, path)
    elif isinstance(shape, Nullable):
        if value is not None:
            _check(value, shape.shape, path)
    elif isinstance(shape, When):
        _check(value, shape.then if isinstance(value, dict) and shape.test(value) else shape.otherwise, path)
    else:
        raise TypeError(f"not a shape: {shape!r}")


def check(doc: Any, shape: Any) -> None:
    """Raise :class:`ShapeError` for the first key of ``doc`` that breaks ``shape`` or holds a non-finite number."""
    _finite(doc, "")
    _check(doc, shape, "")


def load(path: Path, shape: Any = ANY) -> Any:
    """Read ``path`` as JSON and :func:`check` it against ``shape``.

    Raises:
        ValueError: one line naming ``path``: it is missing or unreadable, not UTF-8, not JSON (a truncated
            file among them: the message gives the line and column where it ends), or the :class:`ShapeError`.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not readable: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: nested too deeply") from None
    try:
        check(doc, shape)
    except ShapeError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return doc
