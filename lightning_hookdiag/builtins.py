"""What a fit runs besides a user's extensions: the built-in components and rules, listed in one place.

A fit builds the components of :data:`COMPONENTS`, then those of the callback's ``extensions=``, in that order; its
rules are :data:`RULES` (:mod:`lightning_hookdiag.rules._builtin`: the rules stay torch-free, so they are listed
there), then the extension rules. Nothing is registered by importing a module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from lightning_hookdiag._batches import batch_rows
from lightning_hookdiag._eval_mode import eval_mode_watch
from lightning_hookdiag._kurtosis import outliers
from lightning_hookdiag._participation import participation_watch
from lightning_hookdiag._precision import precision_headroom
from lightning_hookdiag._precursor_probes import probes
from lightning_hookdiag._saved_memory import saved_bytes
from lightning_hookdiag._unregistered import unregistered_watch
from lightning_hookdiag.components import ComponentFactory
from lightning_hookdiag.rules._builtin import RULES
from lightning_hookdiag.rules._registry import Rule

__all__ = ["COMPONENTS", "NO_EXTENSIONS", "RULES", "Extensions", "every_rule", "split_extensions"]

COMPONENTS: tuple[ComponentFactory, ...] = (
    batch_rows,  # repeated_batch's facts
    eval_mode_watch,  # eval_mode's facts
    outliers,  # act_kurtosis, act_absmax_over_std
    precision_headroom,  # act_overflow_frac_*, act_grad_overflow_frac_*
    probes,  # the precursor statistics
    saved_bytes,  # act_saved_bytes
    unregistered_watch,  # unregistered_module's facts
    participation_watch,  # the participation rules' facts, read at the step (issue 38)
)
"""The built-in component factories, in the order their components are driven."""


class Extensions(NamedTuple):
    """A callback's ``extensions=``, split: its component factories and its rules, each in the order given."""

    components: tuple[ComponentFactory, ...] = ()
    rules: tuple[Rule, ...] = ()


NO_EXTENSIONS = Extensions()
"""A callback without extensions."""


def split_extensions(extensions: Iterable[object]) -> Extensions:
    """Validate ``extensions`` and split them into component factories and rules.

    Raises:
        ValueError: If an entry is neither a :class:`~lightning_hookdiag.rules.Rule` (made with ``@rule``) nor a
            :class:`~lightning_hookdiag.components.ComponentFactory` (made with ``@component``), or if a rule's name
            is taken (by a built-in rule or an earlier entry). The message names the entry and what is valid.
    """
    if isinstance(extensions, (str, bytes)) or not isinstance(extensions, Iterable):
        raise ValueError(
            f"extensions: expected a sequence of rules (@rule) and component factories (@component), got {extensions!r}"
        )
    components: list[ComponentFactory] = []
    rules: list[Rule] = []
    taken = {r.name: "a built-in rule" for r in RULES}
    for i, entry in enumerate(extensions):
        if isinstance(entry, ComponentFactory):
            components.append(entry)
        elif isinstance(entry, Rule):
            if entry.name in taken:
                raise ValueError(f"extensions[{i}]: rule name {entry.name!r} is taken by {taken[entry.name]}")
            taken[entry.name] = f"extensions[{i}]"
            rules.append(entry)
        else:
            raise ValueError(
                f"extensions[{i}]: expected a rule (a function decorated with lightning_hookdiag.rules.rule) or a"
                f" component factory (decorated with lightning_hookdiag.components.component), got {entry!r}"
            )
    return Extensions(tuple(components), tuple(rules))


def every_rule(extensions: Extensions) -> Sequence[Rule]:
    """The built-in rules, then the extension rules."""
    return (*RULES, *extensions.rules)
