"""The public surface, snapshotted: a change to it is deliberate (update ``public_api.txt`` in the same change).

The surface is every module whose dotted path has no part starting with ``_`` (the package, ``rules``, ``report``
and the extension API), the names each exports in ``__all__``, and the signature of each exported function and
class. Regenerate after a deliberate change with
``HOOKDIAG_UPDATE_SNAPSHOT=1 python -m pytest tests/repo/test_public_api.py``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from pathlib import Path

import lightning_hookdiag

SNAPSHOT = Path(__file__).with_name("public_api.txt")


def public_modules() -> list[str]:
    """Every importable module of the package without a private part in its path, sorted."""
    names = ["lightning_hookdiag"]
    for info in pkgutil.walk_packages(lightning_hookdiag.__path__, "lightning_hookdiag."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    return sorted(names)


def signature(obj: object) -> str:
    """``obj``'s signature, with a long default (a tuple of the built-in rules) shown by its type only.

    The defaults' reprs would otherwise hold memory addresses and change with every rule added.
    """
    sig = inspect.signature(obj)  # type: ignore[arg-type]
    params = []
    for p in sig.parameters.values():
        if p.default is not inspect.Parameter.empty and len(repr(p.default)) > 80:
            p = p.replace(default=_Short(type(p.default).__name__))
        params.append(p)
    return str(sig.replace(parameters=params))


class _Short:
    """A default shown as ``<type>``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def describe(obj: object) -> str:
    """A one-line description: the kind and, for callables, the signature."""
    kind = "class" if inspect.isclass(obj) else "def" if callable(obj) else None
    if kind is None:
        return type(obj).__name__
    try:
        return f"{kind}{signature(obj)}"
    except (TypeError, ValueError):
        return kind


def surface() -> str:
    """The surface as text: one line per exported name of each public module."""
    lines = []
    for name in public_modules():
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            lines.append(f"{name}: (no __all__)")
            continue
        for export in sorted(exported):
            lines.append(f"{name}.{export}: {describe(getattr(module, export))}")
    return "\n".join(lines) + "\n"


def test_the_public_surface_is_the_snapshot() -> None:
    now = surface()
    if os.environ.get("HOOKDIAG_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(now)
    assert now == SNAPSHOT.read_text(), (
        "the public surface changed; if that is deliberate, regenerate tests/repo/public_api.txt with"
        " HOOKDIAG_UPDATE_SNAPSHOT=1 and say so in CHANGELOG.md"
    )


def test_only_the_documented_modules_are_public() -> None:
    assert public_modules() == [
        "lightning_hookdiag",
        "lightning_hookdiag.builtins",
        "lightning_hookdiag.components",
        "lightning_hookdiag.report",
        "lightning_hookdiag.rules",
    ]
