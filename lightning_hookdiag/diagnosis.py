"""The rules' memory between sampled steps: one step's statistics in, its findings and the new ones out.

:class:`Diagnosis` owns what the rules of :mod:`lightning_hookdiag.rules` read besides the step's own values (the
``loss_spike`` baseline, the last step each parameter's norm was finite, the trend history) and the
:class:`~lightning_hookdiag.rules.AlertState` that decides which findings are new; it updates them in one place,
after the rules ran. The callback routes what it gets back: it keeps the findings, warns, raises or stops. Pure
Python (no torch, no Lightning), so it is tested by hand; its :meth:`Diagnosis.state_dict` holds only JSON types
and is a part of the callback's checkpoint state. The rules: ``docs/rules.md``.

Example:
    >>> diagnosis = Diagnosis(RuleConfig())
    >>> dead = {"act_dead_frac": {"relu": 1.0}}
    >>> [len(diagnosis.step(dead, ["relu"], [], step=s).new) for s in (0, 2)]  # alerts once while it persists
    [1, 0]
    >>> diagnosis.step({"act_dead_frac": {"relu": 0.0}}, ["relu"], [], step=4).findings
    []
    >>> [f.rule for f in diagnosis.step(dead, ["relu"], [], step=6).new]  # back after clearing: alerts again
    ['dead_units']
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from lightning_hookdiag.rules import (
    AlertState,
    Baseline,
    Finding,
    ParamFacts,
    RuleConfig,
    evaluate,
    values_from_metrics,
)
from lightning_hookdiag.trends import History

if TYPE_CHECKING:  # only a Trip's fields are read; importing the sentinel at run time would import torch
    from lightning_hookdiag.step_state import Trip

__all__ = ["Diagnosed", "Diagnosis"]


class Diagnosed(NamedTuple):
    """What one evaluated step found.

    Attributes:
        findings: Every finding of the step, earliest origin first (as :func:`~lightning_hookdiag.rules.evaluate`).
        new: Those to alert on: a (rule, layer) pair absent on the previous evaluated step, and every event.
    """

    findings: list[Finding]
    new: list[Finding]


class Diagnosis:
    """Evaluate the rules on each sampled (or tripped) step, with what earlier steps left behind.

    Args:
        config: The rules and thresholds; its ``trend_window`` sizes the history.

    Attributes:
        config: As given.
        alerts: Which (rule, layer) pairs are active, and every rule's finding count.
        baseline: The values of the last step evaluated without a sentinel trip, which ``loss_spike`` compares with;
            ``None`` before one. Not checkpointed.
        last_finite: Parameter name to the last evaluated step on which its ``param_norm`` was finite.
        history: The earlier evaluated steps' values, for the trend rules.

    Example:
        >>> diagnosis = Diagnosis(RuleConfig())
        >>> _ = diagnosis.step({"param_norm": {"w": 2.0}}, ["fc"], [], step=3)
        >>> _ = diagnosis.step({"param_norm": {"w": float("nan")}}, ["fc"], [], step=5)
        >>> diagnosis.last_finite, diagnosis.baseline.step
        ({'w': 3}, 5)
    """

    def __init__(self, config: RuleConfig) -> None:
        self.config = config
        self.alerts = AlertState()
        self.baseline: Baseline | None = None
        self.last_finite: dict[str, int] = {}
        self.history = self._new_history()

    def _new_history(self) -> History:
        return History(4 * self.config.trend_window)  # logit_drift looks back this far

    def step(
        self,
        values: Mapping[str, Mapping[str, float]],
        forward_order: Sequence[str],
        backward_order: Sequence[str],
        step: int,
        layer_types: Mapping[str, str] | None = None,
        *,
        trip: Trip | None = None,
        missing_grads: Collection[str] = (),
        eval_mode: Mapping[str, str] | None = None,
        param_facts: Mapping[str, ParamFacts] | None = None,
        unregistered: Mapping[str, Sequence[str]] | None = None,
    ) -> Diagnosed:
        """Evaluate one step's values, then remember them for the next: call it once per evaluated step.

        The arguments are those of :func:`~lightning_hookdiag.rules.evaluate`, without the memory this object
        keeps. Afterwards the step's values are in :attr:`history`, each finite ``param_norm`` in
        :attr:`last_finite`, the values are the :attr:`baseline` unless the sentinel tripped on the step (a
        spike is not compared with itself next time), and :attr:`alerts` has the step's findings.
        """
        findings = evaluate(
            values,
            forward_order,
            backward_order,
            step,
            self.config,
            layer_types,
            trip=trip,
            baseline=self.baseline,
            last_finite=self.last_finite,
            missing_grads=missing_grads,
            eval_mode=eval_mode,
            param_facts=param_facts,
            history=self.history,
            unregistered=unregistered,
        )
        self.history.push(step, values)
        for name, norm in values.get("param_norm", {}).items():
            if math.isfinite(norm):
                self.last_finite[name] = step
        if trip is None:
            self.baseline = Baseline(step, values)
        return Diagnosed(findings, self.alerts.update(findings))

    def traces(self, trip: Trip) -> bool:
        """Whether a tripped step's NaN/Inf is worth tracing to the module that made it (only ``nonfinite`` reads it).

        Example:
            >>> from lightning_hookdiag.step_state import Trip
            >>> nan, spike = Trip(3, "nonfinite_loss", float("nan")), Trip(3, "loss_spike", 40.0, baseline=1.0)
            >>> Diagnosis(RuleConfig()).traces(nan), Diagnosis(RuleConfig()).traces(spike)
            (True, False)
            >>> Diagnosis(RuleConfig(enabled=["dead_units"])).traces(nan)
            False
        """
        return trip.kind != "loss_spike" and "nonfinite" in self.config.enabled

    def state_dict(self) -> dict[str, Any]:
        """``{"alerts": ..., "last_finite": ..., "history": ...}``, JSON types only: the keys of the callback's state.

        The baseline is not saved apart: :meth:`load_state_dict` takes it back from the last logged step's metrics,
        which the callback's state holds anyway.
        """
        return {
            "alerts": self.alerts.state_dict(),
            "last_finite": dict(self.last_finite),
            "history": self.history.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], prefix: str = "layer_health") -> None:
        """Restore what :meth:`state_dict` returned; missing keys mean an empty state.

        The callback's whole state is passed: the baseline is its last logged step (``last_step``,
        ``last_metrics`` under ``prefix``) unless the sentinel tripped on that step (listed in ``trips``), so the
        first spike after a resume is compared with the layers before it. Other keys are ignored.

        Raises:
            ValueError: If the alerts or the history are malformed.
        """
        self.alerts.load_state_dict(state_dict.get("alerts", {}))
        self.last_finite = dict(state_dict.get("last_finite", {}))
        self.history.load_state_dict(state_dict.get("history", {}))
        self.baseline = _resumed_baseline(state_dict, prefix)


def _resumed_baseline(state_dict: Mapping[str, Any], prefix: str) -> Baseline | None:
    """The baseline a checkpoint implies: its last logged step, unless that step tripped (then none is known)."""
    step = state_dict.get("last_step")
    if step is None or any(trip.get("step") == step for trip in state_dict.get("trips", [])):
        return None
    values = values_from_metrics(state_dict.get("last_metrics", {}), prefix)
    return Baseline(int(step), values) if values else None
