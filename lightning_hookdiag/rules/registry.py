"""Which rules exist: adding one is one function, registered by :func:`rule` where it is written.

A rule is a function of a :class:`~lightning_hookdiag.rules.context.Context` that yields :class:`Found` tuples; the
registry turns them into :class:`~lightning_hookdiag.rules.Finding` objects, the one place a finding is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from lightning_hookdiag.rules.findings import Finding

__all__ = ["REGISTRY", "Found", "Rule", "registered", "rule"]


class Found(NamedTuple):
    """A :class:`~lightning_hookdiag.rules.Finding` less the rule's name and the step; ``None``: the rule's own."""

    layer: str
    value: float
    message: str
    threshold: float = 0.0
    phase: str | None = None
    stat: str | None = None


# Of a Context, which is not named here: it imports the configuration, which reads this registry.
Check = Callable[[Any], Iterable[Found]]


@dataclass(frozen=True)
class Rule:
    """A registered rule (see :func:`rule` for the fields)."""

    name: str
    check: Check
    order: float
    phase: str
    stat: str
    reads: tuple[str, ...]
    event: bool
    uses: tuple[str, ...] = ()

    def run(self, ctx: Any) -> list[Finding]:
        """The rule's findings on ``ctx``; none when a part of the context it reads is absent or empty."""
        if not all(getattr(ctx, part) for part in self.reads):
            return []
        step, phase, stat = ctx.step, self.phase, self.stat
        return [
            Finding(self.name, f.layer, step, float(f.value), f.threshold, f.message, f.phase or phase, f.stat or stat)
            for f in self.check(ctx)
        ]


REGISTRY: dict[str, Rule] = {}
"""Rule name to :class:`Rule`, filled by :func:`rule` as the rule modules are imported."""


def rule(
    order: float,
    phase: str,
    stat: str,
    *,
    name: str | None = None,
    reads: Iterable[str] = (),
    event: bool = False,
    uses: Iterable[str] = (),
) -> Callable[[Check], Check]:
    """Register the decorated function as a rule, under its own name unless ``name`` is given.

    Args:
        order: Where the rule's findings sort among those of the same layer (lower first).
        phase: Its findings' default phase: ``"forward"`` (about activations) or ``"backward"`` (about gradients).
        stat: Its findings' default statistic.
        name: The rule's name; by default the function's.
        reads: Parts of the context (``"trip"``, ``"param_facts"``) without which the rule says nothing.
        event: Whether each finding is an event of one step that alerts every time (``loss_spike``), not a
            condition that persists until it clears.
        uses: Parts of the context the rule reads where present, without needing them for all it says: gathered
            for it like ``reads`` (``input_scale`` reads the weights' shapes in ``"param_facts"`` for its small side).

    Raises:
        ValueError: If a rule of that name is registered already.

    Example:
        >>> @rule(order=99, phase="forward", stat="act_std", name="doc_quiet")
        ... def quiet(ctx):
        ...     return []
        >>> REGISTRY["doc_quiet"].phase, [r.name for r in registered()][-1]
        ('forward', 'doc_quiet')
        >>> del REGISTRY["doc_quiet"]
    """

    def register(check: Check) -> Check:
        key = name or check.__name__
        if key in REGISTRY:
            raise ValueError(f"rule: {key!r} is registered already (by {REGISTRY[key].check.__module__})")
        REGISTRY[key] = Rule(key, check, order, phase, stat, tuple(reads), event, tuple(uses))
        return check

    return register


def any_reads(part: str, names: Iterable[str]) -> bool:
    """Whether any of the rules ``names`` reads or uses ``part`` of the context (asked live: extension rules count)."""
    return any(n in REGISTRY and (part in REGISTRY[n].reads or part in REGISTRY[n].uses) for n in names)


def registered() -> list[Rule]:
    """Every registered rule, in the order findings of the same layer are listed."""
    return sorted(REGISTRY.values(), key=lambda r: r.order)
