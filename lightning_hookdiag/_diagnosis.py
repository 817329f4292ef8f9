"""The rules' memory between sampled steps: one step's statistics in, its findings and the new ones out.

:class:`Diagnosis` updates what the rules read besides the step's own values in one place, after the rules ran; the
callback routes what it gets back (keeps the findings, warns, raises or stops). Pure Python, tested by hand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from lightning_hookdiag._trends import History
from lightning_hookdiag.rules import (
    BUILTIN_RULES,
    AlertState,
    Baseline,
    Finding,
    Memory,
    Observed,
    Rule,
    RuleConfig,
    evaluate,
    values_from_metrics,
)

if TYPE_CHECKING:
    from lightning_hookdiag._step_state import Trip

__all__ = ["Diagnosed", "Diagnosis"]


class Diagnosed(NamedTuple):
    """What one evaluated step found: every finding, earliest origin first, and the ``new`` ones to alert on."""

    findings: list[Finding]
    new: list[Finding]


class Diagnosis:
    """Evaluate the rules (``config``) on each sampled (or tripped) step, with what earlier steps left behind.

    Args:
        config: Which rules run, and their thresholds.
        rules: Every rule of the callback: the built-ins, then its extension rules.

    Raises:
        ValueError: If ``config.enabled`` names a rule not in ``rules`` (:meth:`RuleConfig.select`).
    """

    def __init__(self, config: RuleConfig, rules: Sequence[Rule] = BUILTIN_RULES) -> None:
        self.config = config
        self.rules = tuple(rules)
        self.enabled = config.select(self.rules)  # checked here: an unknown name fails when the callback is built
        self.alerts = AlertState(self.rules)  # the active (rule, layer) pairs, and every rule's finding count
        self.baseline: Baseline | None = None  # the last step evaluated without a trip: what loss_spike compares with
        self.last_finite: dict[str, int] = {}  # parameter name to the last evaluated step its param_norm was finite
        self.history = History(4 * config.trend_window)  # for the trend rules: logit_drift looks back 4 windows

    def step(self, observed: Observed) -> Diagnosed:
        """Evaluate ``observed`` with this object's memory (:func:`~lightning_hookdiag.rules.evaluate`).

        Call it once per evaluated step. Its values become the :attr:`baseline` unless the sentinel tripped on it (a
        spike is not compared with itself next time).
        """
        step, values = observed.step, observed.values
        memory = Memory(self.baseline, self.last_finite, self.history)
        findings = evaluate(observed, memory, self.config, rules=self.rules)
        self.history.push(step, values)
        self.last_finite |= {name: step for name, norm in values.get("param_norm", {}).items() if math.isfinite(norm)}
        if observed.facts.get("trip") is None:
            self.baseline = Baseline(step, values)
        return Diagnosed(findings, self.alerts.update(findings))

    def traces(self, trip: Trip) -> bool:
        """Whether to trace a tripped step's NaN/Inf to the module that made it (only rule ``nonfinite`` reads it)."""
        return trip.kind != "loss_spike" and any(r.name == "nonfinite" for r in self.enabled)

    def state_dict(self) -> dict[str, Any]:
        """``{"alerts": ..., "last_finite": ..., "history": ...}``, JSON types only: the keys of the callback's state.

        The baseline is not saved apart: it is the last logged step, which the callback's state holds anyway.
        """
        return {
            "alerts": self.alerts.state_dict(),
            "last_finite": dict(self.last_finite),
            "history": self.history.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], prefix: str = "layer_health") -> None:
        """Restore from the callback's whole state; missing keys mean an empty state, other keys are ignored.

        The baseline is its last logged step (``last_step``, ``last_metrics`` under ``prefix``) unless the sentinel
        tripped on that step (listed in ``trips``), so the first spike after a resume is compared with the layers
        before it.

        Raises:
            ValueError: If the alerts or the history are malformed.
        """
        self.alerts.load_state_dict(state_dict.get("alerts", {}))
        self.last_finite = dict(state_dict.get("last_finite", {}))
        self.history.load_state_dict(state_dict.get("history", {}))
        step, self.baseline = state_dict.get("last_step"), None
        if step is not None and all(trip.get("step") != step for trip in state_dict.get("trips", [])):
            values = values_from_metrics(state_dict.get("last_metrics", {}), prefix)
            self.baseline = Baseline(int(step), values) if values else None
