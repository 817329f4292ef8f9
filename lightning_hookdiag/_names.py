"""The logged names: module and parameter paths without wrapper segments, and the pseudo-layers of findings.

Wrapper segments (``torch.compile``, activation checkpointing, FSDP1, Lightning's strategy wrappers, DDP) are left
out, so the keys of a run do not change when the model is compiled, wrapped or sharded. No torch import: the report
uses it on any machine. The names as a user sees them: ``docs/statistics.md#names``.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

__all__ = ["BATCH", "LOSS", "ROOT", "MODULE_ATTR_WRAPPERS", "WRAPPER_SEGMENTS", "logged_name", "owning_layer"]

LOSS = "loss"
"""The ``layer`` of a finding about the loss itself rather than about one layer."""

BATCH = "<batch>"
"""The ``layer`` of a finding about the training batch itself, before any layer: a batch that arrives holding NaN/Inf
(``nonfinite``), or one sample repeated (``repeated_batch``)."""

ROOT = "<root>"
"""The ``layer`` of a finding about the LightningModule's own code: a NaN made in its ``forward`` (or, outside every
module's forward, in ``training_step``) between two layers. Module names are relative to the LightningModule, whose
own name would be empty; the angle brackets cannot occur in a module path."""

WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_forward_module"})
"""Attribute names under which wrappers keep the module they wrap: private names no user model would choose, so
they are dropped wherever they appear."""

MODULE_ATTR_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel", "_LightningModuleWrapperBase"})
"""Classes (or their subclasses) that keep the wrapped module as ``module``: a name users do choose, so it is
dropped only below these."""


def logged_name(path: str, root: Any = None) -> str:
    """The logged name of the module or parameter at dotted ``path`` (as ``named_modules()`` gives it) of ``root``.

    With ``root``, a ``module`` segment is dropped where its parent is a DDP-style wrapper (see
    :data:`MODULE_ATTR_WRAPPERS`); without it, ``module`` segments are kept.
    """
    if root is None or "module" not in path.split("."):  # the walk below only decides what a "module" segment is
        return _plain_logged_name(path)
    kept = []
    parent = root
    for segment in path.split("."):
        wrapped = segment == "module" and any(cls.__name__ in MODULE_ATTR_WRAPPERS for cls in type(parent).__mro__)
        if segment not in WRAPPER_SEGMENTS and not wrapped:
            kept.append(segment)
        parent = getattr(parent, segment, None) if parent is not None else None
    return ".".join(kept)


def owning_layer(parameter: str, layers: Collection[str] = ()) -> str:
    """The layer a parameter's statistics belong to, given its logged name or raw path.

    The longest name of the known ``layers`` that is a dotted prefix of the parameter's logged name (a selected
    container owns ``<container>.<child>.weight``); without one, the name minus its last segment.
    """
    name = _plain_logged_name(parameter)
    # The dotted prefixes, longest first: a loop of rpartitions, as a sampled step asks this ~300 times.
    prefix, dot, _ = name.rpartition(".")
    while dot:
        if prefix in layers:
            return prefix
        prefix, dot, _ = prefix.rpartition(".")
    return name.rpartition(".")[0] or name


@functools.lru_cache(maxsize=4096)
def _plain_logged_name(path: str) -> str:
    """:func:`logged_name` without a root (a pure function of ``path``, so cached: the rules ask per parameter)."""
    return ".".join(segment for segment in path.split(".") if segment not in WRAPPER_SEGMENTS)
