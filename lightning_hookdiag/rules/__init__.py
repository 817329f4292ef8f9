"""Health rules: turn one sampled step's pooled statistics into findings, and decide which of them to alert on.

Pure Python on plain floats (no torch, no Lightning), so the rules can be unit-tested by hand and run on the values
of any logger. Every rule reads only the statistics it needs and does nothing when one is absent (the user chose a
subset) or not finite where a finite value is required.

Import from ``lightning_hookdiag.rules``. Each rule is one function made a rule where it is written
(:func:`~lightning_hookdiag.rules._registry.rule`), in one module per family, and listed in ``builtin``; ``context`` is
what a rule reads (the step's facts by name), ``evaluation`` runs the enabled rules and sorts their findings,
``alerts`` decides which are new.

The rules, their :class:`RuleConfig` fields and defaults, what each finding names, the rationale of every default
threshold, and the blind spots: ``docs/rules.md`` (the sentinel's fields: ``docs/sentinel.md``).

Example:
    >>> values = {"act_nonfinite": {"enc": 0.0, "mid": 12.0, "head": 40.0}}
    >>> orders = {"forward_order": ["enc", "mid", "head"], "backward_order": ["head", "mid", "enc"]}
    >>> [f.message for f in evaluate(Observed(7, values, orders))]
    ['nonfinite: 12 NaN/Inf output elements in mid at step 7 (the first non-finite layer in forward order; 1 more layer after it is also non-finite: head)']
"""  # noqa: E501

from lightning_hookdiag._names import BATCH, LOSS, ROOT
from lightning_hookdiag.rules._activations import SATURATING_TYPES
from lightning_hookdiag.rules._alerts import AlertState
from lightning_hookdiag.rules._builtin import RULES as BUILTIN_RULES
from lightning_hookdiag.rules._config import RuleConfig
from lightning_hookdiag.rules._context import Baseline, Memory, Observed, ParamFacts
from lightning_hookdiag.rules._evaluation import evaluate, format_error, values_from_metrics
from lightning_hookdiag.rules._findings import Finding
from lightning_hookdiag.rules._gradients import cut_off
from lightning_hookdiag.rules._parameters import moved_mass_bound
from lightning_hookdiag.rules._registry import Found, Rule, rule

RULES: tuple[str, ...] = tuple(r.name for r in BUILTIN_RULES)
"""Names of the built-in rules, in the order findings of the same layer are listed."""

__all__ = [
    "BATCH",
    "LOSS",
    "ROOT",
    "RULES",
    "SATURATING_TYPES",
    "BUILTIN_RULES",
    "AlertState",
    "Baseline",
    "Finding",
    "Found",
    "Memory",
    "Observed",
    "ParamFacts",
    "Rule",
    "RuleConfig",
    "cut_off",
    "evaluate",
    "format_error",
    "moved_mass_bound",
    "rule",
    "values_from_metrics",
]
