"""The names of the statistics: one definition for the callback (which needs torch) and the report (which must not).

What each statistic is: ``docs/statistics.md#every-key`` (``tests/test_docs.py`` checks that every name here has a
row there).

Example:
    >>> LAYER_STATS[:2], TOTAL_STATS
    (('act_mean', 'act_std'), ('grad_norm_total',))
"""

from __future__ import annotations

__all__ = [
    "ACTIVATION_STATS",
    "ALL_STATS",
    "GRADIENT_STATS",
    "LAYER_STATS",
    "OPT_IN_STATS",
    "PARAMETER_STATS",
    "PER_PARAMETER_STATS",
    "PRECURSOR_STATS",
    "TOTAL_STATS",
]

ACTIVATION_STATS: tuple[str, ...] = (
    "act_mean",
    "act_std",
    "act_absmax",
    "act_zero_frac",
    "act_nonfinite",
    "act_dead_frac",
)
"""Statistics of a module's output, keyed by module name."""

GRADIENT_STATS: tuple[str, ...] = ("act_grad_norm", "act_grad_nonfinite")
"""Statistics of the gradient of the loss with respect to a module's output, keyed by module name."""

LAYER_STATS: tuple[str, ...] = ACTIVATION_STATS + GRADIENT_STATS
"""Every statistic keyed by module name."""

PER_PARAMETER_STATS: tuple[str, ...] = ("param_norm", "param_grad_norm", "param_update_ratio")
"""Statistics of parameters around the optimizer step, keyed by dotted parameter name."""

TOTAL_STATS: tuple[str, ...] = ("grad_norm_total",)
"""Statistics with one value per step and no name part in their key."""

PARAMETER_STATS: tuple[str, ...] = PER_PARAMETER_STATS + TOTAL_STATS
"""Every statistic computed from parameters."""

ALL_STATS: tuple[str, ...] = LAYER_STATS + PARAMETER_STATS
"""Every statistic computed when ``stats=None`` (the default set)."""

PRECURSOR_STATS: tuple[str, ...] = ("attn_logit_max", "logit_lse_mean", "logit_absmax")
"""Instability precursors (:mod:`lightning_hookdiag.attention`): the largest attention logit per attention module,
and ``log Z`` / the largest ``|logit|`` of the output layer. Opt-in (see the cost in the benchmark README)."""

OPT_IN_STATS: tuple[str, ...] = (
    "act_kurtosis",
    "act_absmax_over_std",
    "act_underflow_frac",
    "act_overflow_frac",
    "act_grad_underflow_frac",
    "act_grad_overflow_frac",
    "act_saved_bytes",
    *PRECURSOR_STATS,
)
"""Statistics computed only when named in ``stats=``; the precision ones are logged once per target dtype, as
``<name>_<target>`` (e.g. ``act_overflow_frac_float16``)."""
