"""Argument checks shared by the callback and the rule settings: one message shape, raised at construction.

Every check raises ``ValueError(f"{name}: expected {valid}, got {value!r}")``, so an error names the argument, what
is valid and the bad value, whichever module validates it. Pure Python (no torch, no Lightning).

Example:
    >>> integer("every_n_steps", 10, "an integer >= 1", lambda v: v >= 1)
    10
    >>> number("dead_frac_threshold", 2, "a number in (0, 1]", lambda v: 0 < v <= 1)
    Traceback (most recent call last):
    ...
    ValueError: dead_frac_threshold: expected a number in (0, 1], got 2
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = ["boolean", "check", "choice", "integer", "module_names", "names", "number"]

T = TypeVar("T")


def check(name: str, value: T, valid: str, ok: Callable[[T], bool]) -> T:
    """``value`` if ``ok(value)``; otherwise the error naming ``name``, ``valid`` and the value.

    Example:
        >>> check("prefix", "a/", "a key segment without a trailing '/'", lambda p: not p.endswith("/"))
        Traceback (most recent call last):
        ...
        ValueError: prefix: expected a key segment without a trailing '/', got 'a/'
    """
    if not ok(value):
        raise ValueError(f"{name}: expected {valid}, got {value!r}")
    return value


def _is_integral(value: Any) -> bool:
    # bool is an int subclass: True would silently become 1. numbers.Integral covers numpy's and other integer
    # scalars (np.bool_ is not registered as one).
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def number(name: str, value: Any, valid: str, ok: Callable[[float], bool]) -> float:
    """A real number for which ``ok`` holds, as a ``float``.

    Any ``numbers.Real`` passes (``int``, ``float``, numpy scalars), never a ``bool``.

    Example:
        >>> number("spike_ratio", 10, "a finite number > 1", lambda v: 1 < v < float("inf"))
        10.0
        >>> number("spike_ratio", True, "a finite number > 1", lambda v: 1 < v < float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: spike_ratio: expected a finite number > 1, got True
    """
    real = check(name, value, valid, lambda v: not isinstance(v, bool) and isinstance(v, numbers.Real) and ok(float(v)))
    return float(real)


def integer(
    name: str, value: Any, valid: str, ok: Callable[[int], bool] = lambda v: True, *, optional: bool = False
) -> Any:
    """An integral number for which ``ok`` holds, as an ``int``; ``None`` passes too when ``optional``.

    Any ``numbers.Integral`` passes (``int``, numpy integers), never a ``bool`` or a ``float``.

    Example:
        >>> import numpy as np
        >>> integer("every_n_steps", np.int64(5), "an integer >= 1", lambda v: v >= 1)
        5
        >>> integer("histogram_bins", 7, "an even integer >= 4", lambda v: v >= 4 and v % 2 == 0)
        Traceback (most recent call last):
        ...
        ValueError: histogram_bins: expected an even integer >= 4, got 7
        >>> integer("unit_dim", None, "an integer axis or None", optional=True) is None
        True
    """
    if optional and value is None:
        return None
    return int(check(name, value, valid, lambda v: _is_integral(v) and ok(int(v))))


def boolean(name: str, value: Any) -> bool:
    """``True`` or ``False`` itself (not ``1`` or ``"false"``).

    Example:
        >>> boolean("summary", "false")
        Traceback (most recent call last):
        ...
        ValueError: summary: expected True or False, got 'false'
    """
    return check(name, value, "True or False", lambda v: isinstance(v, bool))


def choice(name: str, value: T, choices: Sequence[Any]) -> T:
    """One of ``choices``.

    Example:
        >>> choice("on_anomaly", "log", ("warn", "raise"))
        Traceback (most recent call last):
        ...
        ValueError: on_anomaly: expected one of ['warn', 'raise'], got 'log'
    """
    return check(name, value, f"one of {list(choices)}", lambda v: v in choices)


def module_names(name: str, value: str | Iterable[str] | None) -> list[str] | None:
    """A module name or glob, or an iterable of them, as a list; ``None`` stays ``None``.

    Example:
        >>> module_names("layers", "model.*"), module_names("exclude", ("a", "b"))
        (['model.*'], ['a', 'b'])
        >>> module_names("layers", ["model.0", ""])
        Traceback (most recent call last):
        ...
        ValueError: layers: expected non-empty module names or globs, got ['']
    """
    if value is None:
        return None
    if not isinstance(value, (str, Iterable)):
        raise ValueError(f"{name}: expected a module name or glob, or a sequence of them, got {value!r}")
    items = [value] if isinstance(value, str) else list(value)
    bad = [v for v in items if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(f"{name}: expected non-empty module names or globs, got {bad!r}")
    return items


def names(name: str, value: str | Iterable[str] | None, known: Sequence[str], what: str = "name") -> list[str]:
    """A name or an iterable of names, each one of ``known``, as a list; ``None`` is the empty list.

    Example:
        >>> names("extra_stats", "act_kurtosis", ["act_mean", "act_kurtosis"], "statistic")
        ['act_kurtosis']
        >>> names("extra_stats", ["act_kurtosis", "act_kurt"], ["act_mean", "act_kurtosis"], "statistic")
        Traceback (most recent call last):
        ...
        ValueError: extra_stats: unknown statistic(s) ['act_kurt']; expected names from ['act_mean', 'act_kurtosis']
    """
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
    if items is None or not all(isinstance(v, str) for v in items):
        raise ValueError(f"{name}: expected None, a {what} name or a sequence of them, got {value!r}")
    unknown = sorted(set(items) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown {what}(s) {unknown}; expected names from {list(known)}")
    return items
