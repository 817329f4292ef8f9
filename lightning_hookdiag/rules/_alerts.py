"""Which findings to alert on (``docs/rules.md#what-happens-when-a-rule-fires``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_hookdiag.rules._builtin import RULES
from lightning_hookdiag.rules._findings import Finding
from lightning_hookdiag.rules._registry import Rule

__all__ = ["AlertState"]


class AlertState:
    """Warn once per (rule, layer) until it clears; count every finding per rule.

    A finding is *new* when its (rule, layer) pair was not found on the previously evaluated step. A pair that is
    absent on a later evaluated step clears, and alerts again when it comes back. Findings of an event rule
    (``loss_spike``) are all new, and none is kept as active (two spikes a few steps apart, with no sampled step
    between them, alert twice). The state is plain Python, so it pickles, and :meth:`state_dict` holds only JSON
    types for checkpoints.

    Args:
        rules: Every rule of the callback (the built-ins, then its extensions): each gets a count.

    Attributes:
        counts: Rule name to the number of findings seen (alerted or not) since the state was created.

    Example:
        >>> from lightning_hookdiag.rules import Observed, evaluate
        >>> state = AlertState()
        >>> dead = evaluate(Observed(0, {"act_dead_frac": {"relu": 1.0}}, {"forward_order": ["relu"]}))
        >>> len(state.update(dead)), len(state.update(dead)), len(state.update([])), len(state.update(dead))
        (1, 0, 0, 1)
        >>> state.counts["dead_units"]
        3
        >>> state.state_dict()["active"]
        [['dead_units', 'relu']]
    """  # noqa: E501

    def __init__(self, rules: Sequence[Rule] = RULES) -> None:
        self._names = tuple(r.name for r in rules)
        self._events = frozenset(r.name for r in rules if r.event)
        self._active: set[tuple[str, str]] = set()
        self.counts: dict[str, int] = dict.fromkeys(self._names, 0)

    @property
    def active(self) -> frozenset[tuple[str, str]]:
        """The (rule, layer) pairs found on the last evaluated step."""
        return frozenset(self._active)

    def update(self, findings: Iterable[Finding]) -> list[Finding]:
        """Record one evaluated step's findings and return those to alert on, in their given order.

        Call it once per evaluated step, also with no findings: that is how pairs clear.
        """
        new: list[Finding] = []
        active: set[tuple[str, str]] = set()
        for f in findings:
            self.counts[f.rule] = self.counts.get(f.rule, 0) + 1
            if f.rule in self._events:
                new.append(f)
                continue
            pair = (f.rule, f.layer)
            # Also once within a step: a layer can be both a backward origin and a parameter-gradient origin.
            if pair not in self._active and pair not in active:
                new.append(f)
            active.add(pair)
        self._active = active
        return new

    def state_dict(self) -> dict[str, Any]:
        """Active pairs (sorted ``[rule, layer]`` lists) and counts: only JSON types."""
        return {"active": [list(pair) for pair in sorted(self._active)], "counts": dict(self.counts)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (missing keys mean an empty state).

        Raises:
            ValueError: If the state is malformed.
        """
        active, counts = state_dict.get("active", []), state_dict.get("counts", {})
        for pair in active:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise ValueError(f"AlertState.load_state_dict: 'active' expects [rule, layer] pairs, got {pair!r}")
        if not isinstance(counts, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in counts.items()
        ):
            raise ValueError(f"AlertState.load_state_dict: 'counts' expects {{rule: count >= 0}}, got {counts!r}")
        self._active = {(rule, layer) for rule, layer in active}
        self.counts = dict.fromkeys(self._names, 0) | dict(counts)
