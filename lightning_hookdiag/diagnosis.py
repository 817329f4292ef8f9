"""The rules' memory between sampled steps: one step's statistics in, its findings and the new ones out.

:class:`Diagnosis` updates what the rules read besides the step's own values in one place, after the rules ran; the
callback routes what it gets back (keeps the findings, warns, raises or stops). Pure Python, tested by hand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from lightning_hookdiag.rules import AlertState, Baseline, Finding, RuleConfig, evaluate, values_from_metrics
from lightning_hookdiag.trends import History

if TYPE_CHECKING:
    from lightning_hookdiag.logged_values import ObservedStep
    from lightning_hookdiag.step_state import Trip

__all__ = ["Diagnosed", "Diagnosis"]


class Diagnosed(NamedTuple):
    """What one evaluated step found: every finding, earliest origin first, and the ``new`` ones to alert on."""

    findings: list[Finding]
    new: list[Finding]


class Diagnosis:
    """Evaluate the rules (``config``) on each sampled (or tripped) step, with what earlier steps left behind."""

    def __init__(self, config: RuleConfig) -> None:
        self.config = config
        self.alerts = AlertState()  # the active (rule, layer) pairs, and every rule's finding count
        self.baseline: Baseline | None = None  # the last step evaluated without a trip: what loss_spike compares with
        self.last_finite: dict[str, int] = {}  # parameter name to the last evaluated step its param_norm was finite
        self.history = History(4 * config.trend_window)  # for the trend rules: logit_drift looks back 4 windows

    def step(
        self,
        values: Mapping[str, Mapping[str, float]],
        observed: ObservedStep,
        layer_types: Mapping[str, str] | None = None,
    ) -> Diagnosed:
        """Evaluate ``values`` with the orders and facts of ``observed`` (:func:`~lightning_hookdiag.rules.evaluate`).

        Call it once per evaluated step. Its values become the :attr:`baseline` unless the sentinel tripped on it (a
        spike is not compared with itself next time); this class supplies the rest of ``evaluate``'s memory.
        """
        step, trip = observed.step, observed.trip
        findings = evaluate(
            values,
            observed.forward_order,
            observed.backward_order,
            step,
            self.config,
            layer_types,
            trip=trip,
            baseline=self.baseline,
            last_finite=self.last_finite,
            missing_grads=observed.missing_grads,
            eval_mode=observed.eval_mode,
            param_facts=observed.param_facts,
            history=self.history,
            unregistered=observed.unregistered,
            participation=observed.participation,
        )
        self.history.push(step, values)
        self.last_finite |= {name: step for name, norm in values.get("param_norm", {}).items() if math.isfinite(norm)}
        if trip is None:
            self.baseline = Baseline(step, values)
        return Diagnosed(findings, self.alerts.update(findings))

    def traces(self, trip: Trip) -> bool:
        """Whether to trace a tripped step's NaN/Inf to the module that made it (only rule ``nonfinite`` reads it)."""
        return trip.kind != "loss_spike" and "nonfinite" in self.config.rule_names

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
