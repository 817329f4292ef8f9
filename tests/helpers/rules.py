"""The health rules run on a hand-made step, through ``lightning_hookdiag.rules``' public ``evaluate``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_hookdiag._trends import History
from lightning_hookdiag.rules import (
    BUILTIN_RULES,
    Baseline,
    Finding,
    Memory,
    Observed,
    Rule,
    RuleConfig,
    evaluate,
)


def run_rules(
    values: Mapping[str, Mapping[str, float]],
    forward_order: Sequence[str] = (),
    backward_order: Sequence[str] = (),
    step: int = 0,
    config: RuleConfig | None = None,
    *,
    baseline: Baseline | None = None,
    last_finite: Mapping[str, int] | None = None,
    history: History | None = None,
    rules: Sequence[Rule] = BUILTIN_RULES,
    **facts: Any,
) -> list[Finding]:
    """``evaluate`` on a step made of ``values``, its orders and ``facts`` (by name), with the memory given."""
    observed = Observed(step, values, {"forward_order": forward_order, "backward_order": backward_order, **facts})
    memory = Memory(baseline, last_finite or {}, history)
    return evaluate(observed, memory, config, rules=rules)
