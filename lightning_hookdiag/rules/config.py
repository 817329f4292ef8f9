"""Which rules exist and which run, with their thresholds: :data:`RULES` and :class:`RuleConfig`.

A configuration is validated when it is built. Every field, its default and why it is that:
``docs/rules.md#why-these-defaults``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_hookdiag.validation import integer, number

__all__ = [
    "EVENT_RULES",
    "RULES",
    "RuleConfig",
]


RULES: tuple[str, ...] = (
    "nonfinite",
    "loss_spike",
    "eval_mode",
    "dead_units",
    "no_gradient",
    "vanishing_gradient",
    "exploding_gradient",
    "saturation",
    "precision_headroom",
    "update_ratio",
    "warmup_stuck",
    "stale_gradients",
    "zeroed_gradients",
    "input_scale",
    "not_updated",
    "replica_divergence",
    "attention_logits",
    "logit_drift",
    "unbounded_loss",
    "update_jump",
    "repeated_batch",
    "unregistered_module",
)
"""Names of the health rules, in the order findings of the same layer are listed."""


EVENT_RULES: frozenset[str] = frozenset({"loss_spike"})
"""Rules whose findings are events of one step (each alerts), not conditions that persist until they clear."""


@dataclass(frozen=True)
class RuleConfig:
    """Which rules run, and their thresholds.

    What each rule fires on: ``docs/rules.md#the-rules``; why each default is what it is:
    ``docs/rules.md#why-these-defaults``.

    Attributes:
        enabled: Names from :data:`RULES` to evaluate (a single name or any iterable is accepted and stored as a
            tuple in :data:`RULES` order). Empty: no rule runs.
        dead_frac_threshold: ``dead_units`` fires when ``act_dead_frac >= dead_frac_threshold``; in ``(0, 1]``.
        vanishing_ratio: ``vanishing_gradient`` fires when, from some layer to the input end, every layer's
            output-gradient norm over the norm at the output end is ``< vanishing_ratio``; in ``(0, 1)``.
        exploding_ratio: ``exploding_gradient`` fires when, from some layer to the input end, every positive ratio
            is ``> exploding_ratio``; finite, ``> 1``.
        saturation_level: An output ``z`` (mapped to ``[-1, 1]``) counts as saturated when ``|z| >
            saturation_level``; in ``(0, 1)``.
        saturation_frac: ``saturation`` fires when the guaranteed share of saturated outputs is ``>=
            saturation_frac``; in ``(0, 1]``.
        spike_window: The sentinel's loss baseline: the number of recent healthy steps kept; an integer ``>= 3``.
        spike_warmup: Healthy steps seen before a loss spike can trip the sentinel; an integer in ``[3,
            spike_window]``.
        spike_zscore: A spike rises more than this many robust standard deviations of the step-to-step loss noise
            (from consecutive differences of the window) above the centre (the lower median of the latest 5);
            ``> 0``.
        spike_ratio: ... and more than this factor above it (see
            :class:`~lightning_hookdiag.sentinel.SpikeDetector`); finite, ``> 1``.
        spike_floor: ... and, on the log scale, the loss reaches at least this share of the run's early loss level
            (the lower median of its first ``spike_warmup`` positive losses); in ``[0, 1)``, 0: no floor.
        spike_growth: ``loss_spike`` names the earliest layer whose activation scale grew more than this factor
            since the last regular sampled step; finite, ``> 1``.
        overflow_frac_threshold: ``precision_headroom`` fires when the share of non-zero values at risk of
            overflowing a target dtype is ``> overflow_frac_threshold``; in ``[0, 1)``.
        update_ratio_low: ``update_ratio`` fires when every layer's update-to-weight ratio is positive and below
            this, on a sampled step and on the previous regular one; in ``(0, 1)``.
        effective_lr_low: ... and every layer's update is also below this many times its gradient
            (``||dw|| / ||g||``, SGD's learning rate); finite, ``> 0``.
        input_scale_limit: ``input_scale`` fires when the first layer's output RMS exceeds this; finite, ``> 1``.
        moved_mass_threshold: ``not_updated`` reports an update as rounded away when at most this share of the
            weights' squared mass can have changed (the bound ``(2 r / eps)**2``); in ``(0, 1]``.
        replica_rtol: ``replica_divergence`` fires when a parameter's largest and smallest norm over processes
            differ by more than this share of the largest; in ``[0, 1)`` (0: any difference).
        attn_logit_threshold: ``attention_logits`` fires when ``attn_logit_max >= attn_logit_threshold``; finite,
            ``> 0``.
        attn_trend_floor: ... or when it is at least ``attn_trend_floor`` and rising steadily towards the threshold
            (``docs/rules.md#the-rules``); in ``[0, attn_logit_threshold)``.
        attn_trend_horizon: ... projected to cross it within this many sampled steps; an integer ``>= 1``.
        trend_window: Sampled steps (the current one included) a trend rule needs before it says anything, and
            looks back over; an integer ``>= 3``.
        logit_drift_nats: ``logit_drift`` fires when the output layer's ``logit_lse_mean`` moved by at least this
            many nats over the window; finite, ``> 0``.
        drift_loss_tolerance: ... while the loss changed by at most this fraction of its value at the window's
            start; in ``(0, 1)``.
        unbounded_growth: ``unbounded_loss`` fires when, over the kept sampled steps (at least ``trend_window``), the
            loss is negative and fell by at least ``unbounded_growth - 1`` times its early value without slowing down,
            while the output layer's ``logit_absmax`` grew by at least this factor; finite, ``> 1``.
        update_jump_ratio: ``update_jump`` fires when a parameter's ``param_update_ratio`` is at least this factor
            above the median of its own window, and this factor above the same jump of the median parameter;
            finite, ``> 1``.

    Raises:
        ValueError: For an invalid field; the message names the field, the value and what is valid.

    Example:
        >>> RuleConfig(dead_frac_threshold=0.5).dead_frac_threshold
        0.5
        >>> RuleConfig(enabled=["saturation", "nonfinite"]).enabled
        ('nonfinite', 'saturation')
        >>> RuleConfig(vanishing_ratio=2)
        Traceback (most recent call last):
        ...
        ValueError: vanishing_ratio: expected a number in (0, 1), got 2
    """

    enabled: tuple[str, ...] = RULES
    dead_frac_threshold: float = 0.9
    vanishing_ratio: float = 1e-3
    exploding_ratio: float = 1e3
    saturation_level: float = 0.9
    saturation_frac: float = 0.5
    spike_window: int = 50
    spike_warmup: int = 20
    spike_zscore: float = 8.0
    spike_ratio: float = 10.0
    spike_floor: float = 1e-2
    spike_growth: float = 10.0
    overflow_frac_threshold: float = 0.0
    update_ratio_low: float = 1e-5
    effective_lr_low: float = 5e-4
    input_scale_limit: float = 20.0
    moved_mass_threshold: float = 0.1
    replica_rtol: float = 1e-6
    attn_logit_threshold: float = 50.0
    attn_trend_floor: float = 10.0
    attn_trend_horizon: int = 10
    trend_window: int = 8
    logit_drift_nats: float = 5.0
    drift_loss_tolerance: float = 0.1
    unbounded_growth: float = 2.0
    update_jump_ratio: float = 5.0

    def __post_init__(self) -> None:
        enabled = self.enabled
        if isinstance(enabled, str):
            enabled = (enabled,)
        try:
            items = list(enabled)
        except TypeError:
            raise ValueError(f"enabled: expected rule names from {list(RULES)}, got {self.enabled!r}") from None
        unknown = sorted({repr(r) for r in items if r not in RULES})
        if unknown:
            raise ValueError(f"enabled: unknown rule(s) {', '.join(unknown)}; expected names from {list(RULES)}")
        # frozen: normalise through object.__setattr__ so that equal configurations compare and hash equal.
        object.__setattr__(self, "enabled", tuple(r for r in RULES if r in items))
        checks: dict[str, tuple[str, Callable[[float], bool]]] = {
            "dead_frac_threshold": ("a number in (0, 1]", lambda v: 0.0 < v <= 1.0),
            "vanishing_ratio": ("a number in (0, 1)", lambda v: 0.0 < v < 1.0),
            "exploding_ratio": ("a finite number > 1", lambda v: 1.0 < v < math.inf),
            "saturation_level": ("a number in (0, 1)", lambda v: 0.0 < v < 1.0),
            "saturation_frac": ("a number in (0, 1]", lambda v: 0.0 < v <= 1.0),
            "spike_zscore": ("a finite number > 0", lambda v: 0.0 < v < math.inf),
            "spike_ratio": ("a finite number > 1", lambda v: 1.0 < v < math.inf),
            "spike_floor": ("a number in [0, 1)", lambda v: 0.0 <= v < 1.0),
            "spike_growth": ("a finite number > 1", lambda v: 1.0 < v < math.inf),
            "overflow_frac_threshold": ("a number in [0, 1)", lambda v: 0.0 <= v < 1.0),
            "update_ratio_low": ("a number in (0, 1)", lambda v: 0.0 < v < 1.0),
            "effective_lr_low": ("a finite number > 0", lambda v: 0.0 < v < math.inf),
            "input_scale_limit": ("a finite number > 1", lambda v: 1.0 < v < math.inf),
            "moved_mass_threshold": ("a number in (0, 1]", lambda v: 0.0 < v <= 1.0),
            "replica_rtol": ("a number in [0, 1)", lambda v: 0.0 <= v < 1.0),
            "attn_logit_threshold": ("a finite number > 0", lambda v: 0.0 < v < math.inf),
            "logit_drift_nats": ("a finite number > 0", lambda v: 0.0 < v < math.inf),
            "drift_loss_tolerance": ("a number in (0, 1)", lambda v: 0.0 < v < 1.0),
            "unbounded_growth": ("a finite number > 1", lambda v: 1.0 < v < math.inf),
            "update_jump_ratio": ("a finite number > 1", lambda v: 1.0 < v < math.inf),
        }
        for name, (valid, ok) in checks.items():
            object.__setattr__(self, name, number(name, getattr(self, name), valid, ok))
        window = integer("spike_window", self.spike_window, "an integer >= 3", lambda v: v >= 3)
        warmup = integer(
            "spike_warmup", self.spike_warmup, f"an integer in [3, spike_window={window}]", lambda v: 3 <= v <= window
        )
        limit = self.attn_logit_threshold
        floor = number(
            "attn_trend_floor",
            self.attn_trend_floor,
            f"a number in [0, attn_logit_threshold={limit:g})",
            lambda v: 0.0 <= v < limit,
        )
        object.__setattr__(self, "attn_trend_floor", floor)
        horizon = integer("attn_trend_horizon", self.attn_trend_horizon, "an integer >= 1", lambda v: v >= 1)
        trend = integer("trend_window", self.trend_window, "an integer >= 3", lambda v: v >= 3)
        # Stored as int: a numpy integer from a config would otherwise leak into arithmetic and checkpoints.
        for name, value in (
            ("spike_window", window),
            ("spike_warmup", warmup),
            ("attn_trend_horizon", horizon),
            ("trend_window", trend),
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> RuleConfig:
        """Build a configuration from a plain mapping, e.g. a YAML section; missing keys keep their defaults.

        Args:
            d: Field names to values (``enabled`` as a list of rule names); ``None`` for the defaults.

        Raises:
            ValueError: For an unknown key (the message lists the valid keys, sorted) or an invalid value.

        Example:
            >>> RuleConfig.from_mapping({"exploding_ratio": 1e4, "enabled": ["nonfinite"]})
            RuleConfig(enabled=('nonfinite',), dead_frac_threshold=0.9, vanishing_ratio=0.001, exploding_ratio=10000.0, saturation_level=0.9, saturation_frac=0.5, spike_window=50, spike_warmup=20, spike_zscore=8.0, spike_ratio=10.0, spike_floor=0.01, spike_growth=10.0, overflow_frac_threshold=0.0, update_ratio_low=1e-05, effective_lr_low=0.0005, input_scale_limit=20.0, moved_mass_threshold=0.1, replica_rtol=1e-06, attn_logit_threshold=50.0, attn_trend_floor=10.0, attn_trend_horizon=10, trend_window=8, logit_drift_nats=5.0, drift_loss_tolerance=0.1, unbounded_growth=2.0, update_jump_ratio=5.0)
            >>> RuleConfig.from_mapping({"dead_frac": 0.5})
            Traceback (most recent call last):
            ...
            ValueError: unknown rule setting(s) ['dead_frac']; valid keys: ['attn_logit_threshold', 'attn_trend_floor', 'attn_trend_horizon', 'dead_frac_threshold', 'drift_loss_tolerance', 'effective_lr_low', 'enabled', 'exploding_ratio', 'input_scale_limit', 'logit_drift_nats', 'moved_mass_threshold', 'overflow_frac_threshold', 'replica_rtol', 'saturation_frac', 'saturation_level', 'spike_floor', 'spike_growth', 'spike_ratio', 'spike_warmup', 'spike_window', 'spike_zscore', 'trend_window', 'unbounded_growth', 'update_jump_ratio', 'update_ratio_low', 'vanishing_ratio']
        """  # noqa: E501
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"rule settings: expected a mapping of setting names to values, got {d!r}")
        valid = sorted(f.name for f in fields(cls))
        unknown = sorted(str(k) for k in d if k not in valid)
        if unknown:
            raise ValueError(f"unknown rule setting(s) {unknown}; valid keys: {valid}")
        return cls(**d)
