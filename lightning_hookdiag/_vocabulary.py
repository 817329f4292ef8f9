"""The names of the statistics, for the callback and for the report (which must not import torch).

What each statistic is: ``docs/statistics.md#every-key`` (``tests/repo/test_docs.py`` checks every name has a row).
"""

from __future__ import annotations

__all__ = [
    "ACTIVATION_STATS",
    "ALL_STATS",
    "GRADIENT_STATS",
    "LAYER_STATS",
    "MOMENT_STATS",
    "OPT_IN_STATS",
    "OUTPUT_LAYER_STATS",
    "PARAMETER_STATS",
    "PER_PARAMETER_STATS",
    "PRECURSOR_STATS",
    "SUMMARIES",
    "TOTAL_STATS",
    "ZERO_IN_HEALTH",
    "counted_by_gradient",
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

OUTPUT_LAYER_STATS: tuple[str, ...] = ("logit_lse_mean", "logit_absmax")
"""The precursors of the model's output layer, the statistics that ``output_layer=`` chooses the layer of."""

PRECURSOR_STATS: tuple[str, ...] = ("attn_logit_max", *OUTPUT_LAYER_STATS)
"""Instability precursors (:mod:`lightning_hookdiag._precursor_probes`): the largest attention logit per attention
module, and ``log Z`` / the largest ``|logit|`` of the output layer. In the default set (cost: the benchmark README)."""

ALL_STATS: tuple[str, ...] = LAYER_STATS + PARAMETER_STATS + PRECURSOR_STATS
"""Every statistic computed when ``stats=None`` (the default set)."""

# act_dead_frac is the one output statistic that comes from the unit maxima, not from the moments.
MOMENT_STATS: tuple[str, ...] = (*(s for s in ACTIVATION_STATS if s != "act_dead_frac"), "act_absmax_over_std")
"""Statistics finalised from an output's moments: outputs are reduced to moments only when one of them is asked for
(otherwise only their element count is kept)."""

OPT_IN_STATS: tuple[str, ...] = (
    "act_kurtosis",
    "act_absmax_over_std",
    "act_underflow_frac",
    "act_overflow_frac",
    "act_grad_underflow_frac",
    "act_grad_overflow_frac",
    "act_saved_bytes",
)
"""Statistics computed only when named in ``stats=``; the precision ones are logged once per target dtype, as
``<name>_<target>`` (e.g. ``act_overflow_frac_float16``)."""


SUMMARIES: dict[str, tuple[str, ...]] = {
    "act_std": ("min",),
    "act_absmax": ("max",),
    "act_nonfinite": ("max",),
    "act_dead_frac": ("max",),
    "act_grad_norm": ("min", "max"),
    "act_grad_nonfinite": ("max",),
    "param_update_ratio": ("min", "max"),
}
"""The summary group: per statistic, the worst layer's (or parameter's) value on each sampled step, logged as
``<prefix>/<stat>_<min|max>`` (``act_std_min``: the most collapsed output, ``act_grad_norm_min``/``_max``: the most
vanishing and the most exploding gradient, ...)."""

ZERO_IN_HEALTH: tuple[str, ...] = ("act_nonfinite", "act_grad_nonfinite")
"""Counts that are 0 in a healthy run: with ``charts="default"`` their per-layer values are logged only on the steps
where a layer's is not (their ``_max`` summary is logged on every sampled step)."""


def counted_by_gradient(stat: str) -> bool:
    """Whether a layer statistic describes the output's gradient, so that it exists where a gradient arrived."""
    return stat in GRADIENT_STATS or stat.startswith("act_grad_")
