"""Which rules run, with their thresholds: :class:`RuleConfig`, each field declared once with what is valid."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from lightning_hookdiag.rules.registry import registered
from lightning_hookdiag.validation import integer, number

__all__ = ["RuleConfig"]

Valid = Callable[[Any, "RuleConfig"], bool]


def _setting(default: float, valid: str, ok: Valid, check: Callable[..., Any] = number) -> Any:
    """A field that ``check`` validates: ``ok(value, config)``, ``valid`` formatted with the fields before it."""
    return field(default=default, metadata={"valid": valid, "ok": ok, "check": check})


def _count(default: int, valid: str, ok: Valid) -> Any:
    return _setting(default, valid, ok, integer)


_UNIT_OPEN = ("a number in (0, 1)", lambda v, _: 0.0 < v < 1.0)
_UNIT_UPPER = ("a number in (0, 1]", lambda v, _: 0.0 < v <= 1.0)
_UNIT_LOWER = ("a number in [0, 1)", lambda v, _: 0.0 <= v < 1.0)
_POSITIVE = ("a finite number > 0", lambda v, _: 0.0 < v < math.inf)
_ABOVE_1 = ("a finite number > 1", lambda v, _: 1.0 < v < math.inf)


def _all_rules() -> tuple[str, ...]:
    return tuple(r.name for r in registered())


@dataclass(frozen=True)
class RuleConfig:
    """Which rules run, and their thresholds, validated when built; each field's docstring says what it does.

    What each rule fires on: ``docs/rules.md#the-rules``; why each default is what it is:
    ``docs/rules.md#why-these-defaults``.

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

    enabled: tuple[str, ...] = field(default_factory=_all_rules)
    """Names of registered rules to evaluate (a single name or any iterable is accepted and stored as a tuple in
    rule order); by default every rule. Empty: no rule runs."""
    dead_frac_threshold: float = _setting(0.9, *_UNIT_UPPER)
    """``dead_units`` fires when ``act_dead_frac >= dead_frac_threshold``."""
    vanishing_ratio: float = _setting(1e-3, *_UNIT_OPEN)
    """``vanishing_gradient`` fires when, from some layer to the input end, every layer's output-gradient norm over
    the norm at the output end is ``< vanishing_ratio``."""
    exploding_ratio: float = _setting(1e3, *_ABOVE_1)
    """``exploding_gradient`` fires when, from some layer to the input end, every positive ratio is ``>
    exploding_ratio``."""
    saturation_level: float = _setting(0.9, *_UNIT_OPEN)
    """An output ``z`` (mapped to ``[-1, 1]``) counts as saturated when ``|z| > saturation_level``."""
    saturation_frac: float = _setting(0.5, *_UNIT_UPPER)
    """``saturation`` fires when the guaranteed share of saturated outputs is ``>= saturation_frac``."""
    spike_window: int = _count(50, "an integer >= 3", lambda v, _: v >= 3)
    """The sentinel's loss baseline: the number of recent healthy steps kept."""
    spike_warmup: int = _count(
        20, "an integer in [3, spike_window={spike_window}]", lambda v, c: 3 <= v <= c.spike_window
    )
    """Healthy steps seen before a loss spike can trip the sentinel."""
    spike_zscore: float = _setting(8.0, *_POSITIVE)
    """A spike rises more than this many robust standard deviations of the step-to-step loss noise (from consecutive
    differences of the window) above the centre (the lower median of the latest 5)."""
    spike_ratio: float = _setting(10.0, *_ABOVE_1)
    """... and more than this factor above it (see :class:`~lightning_hookdiag.sentinel.SpikeDetector`)."""
    spike_floor: float = _setting(1e-2, *_UNIT_LOWER)
    """... and, on the log scale, the loss reaches at least this share of the run's early loss level (the lower
    median of its first ``spike_warmup`` positive losses); 0: no floor."""
    spike_growth: float = _setting(10.0, *_ABOVE_1)
    """``loss_spike`` names the earliest layer whose activation scale grew more than this factor since the last
    regular sampled step."""
    overflow_frac_threshold: float = _setting(0.0, *_UNIT_LOWER)
    """``precision_headroom`` fires when the share of non-zero values at risk of overflowing a target dtype is ``>
    overflow_frac_threshold``."""
    update_ratio_low: float = _setting(1e-5, *_UNIT_OPEN)
    """``update_ratio`` fires when every layer's update-to-weight ratio is positive and below this, on a sampled step
    and on the previous regular one."""
    effective_lr_low: float = _setting(5e-4, *_POSITIVE)
    """... and every layer's update is also below this many times its gradient (``||dw|| / ||g||``, SGD's learning
    rate)."""
    input_scale_limit: float = _setting(20.0, *_ABOVE_1)
    """``input_scale`` fires when the first layer's output RMS exceeds this."""
    moved_mass_threshold: float = _setting(0.1, *_UNIT_UPPER)
    """``not_updated`` reports an update as rounded away when at most this share of the weights' squared mass can
    have changed (the bound ``(2 r / eps)**2``)."""
    replica_rtol: float = _setting(1e-6, *_UNIT_LOWER)
    """``replica_divergence`` fires when a parameter's largest and smallest norm over processes differ by more than
    this share of the largest (0: any difference)."""
    attn_logit_threshold: float = _setting(50.0, *_POSITIVE)
    """``attention_logits`` fires when ``attn_logit_max >= attn_logit_threshold``."""
    attn_trend_floor: float = _setting(
        10.0,
        "a number in [0, attn_logit_threshold={attn_logit_threshold:g})",
        lambda v, c: 0.0 <= v < c.attn_logit_threshold,
    )
    """... or when it is at least ``attn_trend_floor`` and rising steadily towards the threshold
    (``docs/rules.md#the-rules``)."""
    attn_trend_horizon: int = _count(10, "an integer >= 1", lambda v, _: v >= 1)
    """... projected to cross it within this many sampled steps."""
    trend_window: int = _count(8, "an integer >= 3", lambda v, _: v >= 3)
    """Sampled steps (the current one included) a trend rule needs before it says anything, and looks back over."""
    logit_drift_nats: float = _setting(5.0, *_POSITIVE)
    """``logit_drift`` fires when the output layer's ``logit_lse_mean`` moved by at least this many nats over the
    window."""
    drift_loss_tolerance: float = _setting(0.1, *_UNIT_OPEN)
    """... while the loss changed by at most this fraction of its value at the window's start."""
    unbounded_growth: float = _setting(2.0, *_ABOVE_1)
    """``unbounded_loss`` fires when, over the kept sampled steps (at least ``trend_window``), the loss is negative
    and fell by at least ``unbounded_growth - 1`` times its early value without slowing down, while the output
    layer's ``logit_absmax`` grew by at least this factor."""
    update_jump_ratio: float = _setting(5.0, *_ABOVE_1)
    """``update_jump`` fires when a parameter's ``param_update_ratio`` is at least this factor above the median of
    its own window, and this factor above the same jump of the median parameter."""

    def __post_init__(self) -> None:
        known = _all_rules()
        enabled = (self.enabled,) if isinstance(self.enabled, str) else self.enabled
        try:
            items = list(enabled)
        except TypeError:
            raise ValueError(f"enabled: expected rule names from {list(known)}, got {self.enabled!r}") from None
        unknown = sorted({repr(r) for r in items if r not in known})
        if unknown:
            raise ValueError(f"enabled: unknown rule(s) {', '.join(unknown)}; expected names from {list(known)}")
        # frozen: normalised through object.__setattr__ so that equal configurations compare and hash equal; the
        # numbers are stored as float and int, so that a numpy scalar from a config leaks into neither arithmetic
        # nor checkpoints.
        object.__setattr__(self, "enabled", tuple(r for r in known if r in items))
        for f in fields(self)[1:]:
            valid, ok = f.metadata["valid"].format(**vars(self)), f.metadata["ok"]
            object.__setattr__(
                self, f.name, f.metadata["check"](f.name, getattr(self, f.name), valid, lambda v, ok=ok: ok(v, self))
            )

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
