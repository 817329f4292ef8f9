"""What the rules find: a :class:`Finding`, and the phrases every message shares (:func:`also`, :func:`spread`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_hookdiag._table import plural

__all__ = ["MAX_LISTED", "PHASES", "Finding", "also", "listing", "plural", "reach", "spread"]


PHASES: tuple[str, ...] = ("forward", "backward")


# Names of the other affected layers listed in a nonfinite message; the count is always complete.
MAX_LISTED = 3


@dataclass(frozen=True)
class Finding:
    """One rule firing for one layer on one step.

    What each rule's layer names: ``docs/rules.md#the-rules``; its value and statistic: the rule's function.

    Attributes:
        rule: Name from :data:`~lightning_hookdiag.rules.RULES`.
        layer: The layer (module name) the finding is about; for findings about parameters, the parameter's
            module (:meth:`~lightning_hookdiag.rules._context.Orders.owner`); ``LOSS`` for the loss itself,
            ``BATCH`` for the step's batch, and, for a NaN made by functional code between two layers, the module
            whose forward made it (not necessarily selected) or ``ROOT``.
        step: The optimizer step the statistics describe.
        value: The observed value compared with ``threshold`` (a count, a fraction, a ratio, a bound).
        threshold: The threshold it crossed (``0.0`` where any count above it fires).
        message: Human-readable sentence naming the rule and the layer.
        phase: ``"forward"`` (about activations) or ``"backward"`` (about gradients).
        stat: The statistic that triggered it, ``loss`` for a finding about the loss itself, e.g. to ignore
            non-finite gradients on steps that an fp16 ``GradScaler`` skips.
    """

    rule: str
    layer: str
    step: int
    value: float
    threshold: float
    message: str
    phase: str
    stat: str

    def __str__(self) -> str:
        return self.message


def listing(names: Sequence[str]) -> str:
    """The first :data:`MAX_LISTED` of ``names``, comma-separated, with ``...`` when there are more."""
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (", ..." if len(names) > MAX_LISTED else "")


def reach(names: Sequence[str]) -> str:
    """Like :func:`listing`, but a cut list ends with the last name, so that it says how far it reaches.

    Example:
        >>> reach(["b", "c", "d", "e", "f"])
        'b, c, d, ..., f'
    """
    if len(names) <= MAX_LISTED + 1:
        return ", ".join(names)
    return f"{listing(names)}, {names[-1]}"


def spread(params: Sequence[str], owners: Sequence[str]) -> str:
    """``"N parameter(s) in M layer(s), the first in forward order: <owners[0]>"``."""
    layers = plural(len(owners), "layer")
    return f"{plural(len(params), 'parameter')} in {layers}, the first in forward order: {owners[0]}"


def also(others: Sequence[str], where: str, what: str, last: bool = False) -> str:
    """``"; N more layer(s){where} is/are also {what}: <listing>"``, or ``""`` without ``others``.

    With ``last``, the names end with the last one (:func:`reach`), for a chain whose extent matters.
    """
    if not others:
        return ""
    verb = "is" if len(others) == 1 else "are"
    names = reach(others) if last else listing(others)
    return f"; {plural(len(others), 'more layer')}{where} {verb} also {what}: {names}"
