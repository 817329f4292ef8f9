"""What a rule is: a function of a :class:`~lightning_hookdiag.rules._context.Context` made a :class:`Rule`.

A rule yields :class:`Found` tuples; :meth:`Rule.run` turns them into :class:`~lightning_hookdiag.rules.Finding`
objects, the one place a finding is built. Nothing is registered: the built-in rules are listed in
:mod:`lightning_hookdiag.rules._builtin`, and a user's rules are passed to the callback (``extensions=``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, SupportsIndex

from lightning_hookdiag.rules._findings import Finding

__all__ = ["Found", "Rule", "by_order", "named_object", "rule"]


class Found(NamedTuple):
    """A :class:`~lightning_hookdiag.rules.Finding` less the rule's name and the step; ``None``: the rule's own."""

    layer: str
    value: float
    message: str
    threshold: float = 0.0
    phase: str | None = None
    stat: str | None = None


# Of a Context, which is not named here: it imports the configuration, which reads the rule type.
Check = Callable[[Any], Iterable[Found]]


@dataclass(frozen=True)
class Rule:
    """A rule (see :func:`rule` for the fields)."""

    name: str
    check: Check
    order: float
    phase: str
    stat: str
    reads: tuple[str, ...]
    event: bool
    uses: tuple[str, ...] = ()

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickle a rule made with ``@rule`` by where it lives: its module attribute is the rule, not the function."""
        if named_object(self.check.__module__, self.check.__qualname__) is self:
            return (named_object, (self.check.__module__, self.check.__qualname__))
        return super().__reduce_ex__(protocol)

    def run(self, ctx: Any) -> list[Finding]:
        """The rule's findings on ``ctx``; none when a fact it reads is absent or empty."""
        if not all(ctx.has(part) for part in self.reads):
            return []
        step, phase, stat = ctx.step, self.phase, self.stat
        return [
            Finding(self.name, f.layer, step, float(f.value), f.threshold, f.message, f.phase or phase, f.stat or stat)
            for f in self.check(ctx)
        ]


def named_object(module: str, qualname: str) -> Any:
    """The object ``qualname`` of ``module`` (``None`` if none): what a pickled rule or component factory loads from."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


def rule(
    order: float,
    phase: str,
    stat: str,
    *,
    name: str | None = None,
    reads: Iterable[str] = (),
    event: bool = False,
    uses: Iterable[str] = (),
) -> Callable[[Check], Rule]:
    """Make the decorated function a :class:`Rule`, named after the function unless ``name`` is given.

    The rule runs where it is listed: the built-ins in :mod:`lightning_hookdiag.rules._builtin`, a user's in the
    callback's ``extensions=``. Nothing is registered process-wide.

    Args:
        order: Where the rule's findings sort among those of the same layer (lower first).
        phase: Its findings' default phase: ``"forward"`` (about activations) or ``"backward"`` (about gradients).
        stat: Its findings' default statistic.
        name: The rule's name; by default the function's.
        reads: Facts of the step (``"trip"``, ``"param_facts"``) or parts of the rules' memory (``"baseline"``)
            without which the rule says nothing.
        event: Whether each finding is an event of one step that alerts every time (``loss_spike``), not a
            condition that persists until it clears.
        uses: Facts the rule reads where present, without needing them for all it says: gathered for it like
            ``reads`` (``input_scale`` reads the weights' shapes in ``"param_facts"`` for its small side).

    Example:
        >>> @rule(order=99, phase="forward", stat="act_std", name="doc_quiet")
        ... def quiet(ctx):
        ...     return []
        >>> quiet.name, quiet.phase
        ('doc_quiet', 'forward')
    """

    def make(check: Check) -> Rule:
        return Rule(name or check.__name__, check, order, phase, stat, tuple(reads), event, tuple(uses))

    return make


def by_order(rules: Iterable[Rule]) -> list[Rule]:
    """``rules`` in the order findings of the same layer are listed (by :attr:`Rule.order`, stable)."""
    return sorted(rules, key=lambda r: r.order)


def reads_any(part: str, rules: Sequence[Rule]) -> bool:
    """Whether any of ``rules`` reads or uses the fact ``part``."""
    return any(part in r.reads or part in r.uses for r in rules)
