"""Argument checks shared by the callback and the rule settings: one message shape, raised at construction.

Every check raises ``ValueError(f"{name}: expected {valid}, got {value!r}")``, so an error names the argument, what
is valid and the bad value, whichever module validates it.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar, overload

__all__ = ["boolean", "check", "choice", "integer", "module_names", "names", "number"]

T = TypeVar("T")


def check(name: str, value: T, valid: str, ok: Callable[[T], bool]) -> T:
    """``value`` if ``ok(value)``; otherwise the error naming ``name``, ``valid`` and the value."""
    if not ok(value):
        raise ValueError(f"{name}: expected {valid}, got {value!r}")
    return value


def number(name: str, value: Any, valid: str, ok: Callable[[float], bool]) -> float:
    """A real number for which ``ok`` holds, as a ``float``: any ``numbers.Real`` (numpy scalars too), never a bool."""
    return float(
        check(name, value, valid, lambda v: not isinstance(v, bool) and isinstance(v, numbers.Real) and ok(float(v)))
    )


@overload
def integer(
    name: str, value: Any, valid: str, ok: Callable[[int], bool] = ..., *, optional: Literal[False] = False
) -> int: ...


@overload
def integer(name: str, value: Any, valid: str, ok: Callable[[int], bool] = ..., *, optional: bool) -> int | None: ...


def integer(
    name: str, value: Any, valid: str, ok: Callable[[int], bool] = lambda v: True, *, optional: bool = False
) -> int | None:
    """An integral number for which ``ok`` holds, as an ``int``, never a ``float``; ``None`` too when ``optional``."""
    if optional and value is None:
        return None
    # bool is an int subclass: True would silently become 1. numbers.Integral covers numpy's and other integer
    # scalars (np.bool_ is not registered as one). The bool test comes first: typeshed does not register bool as an
    # Integral, so after the Integral test a type checker would call the bool test unreachable.
    return int(
        check(name, value, valid, lambda v: not isinstance(v, bool) and isinstance(v, numbers.Integral) and ok(int(v)))
    )


def boolean(name: str, value: Any) -> bool:
    """``True`` or ``False`` itself (not ``1`` or ``"false"``)."""
    # bool() of a checked bool is the value itself; it gives the result its type, as int() and float() do above.
    return bool(check(name, value, "True or False", lambda v: isinstance(v, bool)))


def choice(name: str, value: T, choices: Sequence[Any]) -> T:
    """One of ``choices``."""
    return check(name, value, f"one of {list(choices)}", lambda v: v in choices)


def module_names(name: str, value: str | Iterable[str] | None) -> list[str] | None:
    """A module name or glob, or an iterable of them, as a list; ``None`` stays ``None``."""
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
    """A name or an iterable of names, each one of ``known``, as a list; ``None`` is the empty list."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
    if items is None or not all(isinstance(v, str) for v in items):
        raise ValueError(f"{name}: expected None, a {what} name or a sequence of them, got {value!r}")
    unknown = sorted(set(items) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown {what}(s) {unknown}; expected names from {list(known)}")
    return items
