"""Which rules run, with their thresholds: :class:`RuleConfig`, each field declared once with what is valid."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field, fields
from typing import Any

from lightning_hookdiag._validation import integer, number
from lightning_hookdiag.rules._registry import Rule, by_order

__all__ = ["DEPRECATED_SPIKE_SETTINGS", "RuleConfig"]

Valid = Callable[[Any, "RuleConfig"], bool]

DEPRECATED_SPIKE_SETTINGS = {
    "spike_window": "window",
    "spike_warmup": "warmup",
    "spike_zscore": "zscore",
    "spike_ratio": "ratio",
    "spike_floor": "floor",
}
"""The sentinel's settings that moved from ``RuleConfig`` to ``SentinelConfig``: old name to new field."""


def _old_name(new: str) -> str:
    """The deprecated ``RuleConfig`` name of ``SentinelConfig`` field ``new``."""
    return next(old for old, field_name in DEPRECATED_SPIKE_SETTINGS.items() if field_name == new)


def _setting(default: float, valid: str, ok: Valid) -> Any:
    """A field valid if ``ok(value, config)`` (an integer if the default is); ``valid`` is formatted with the fields."""
    return field(
        default=default, metadata={"valid": valid, "ok": ok, "check": integer if type(default) is int else number}
    )


_UNIT_OPEN = ("a number in (0, 1)", lambda v, _: 0.0 < v < 1.0)
_UNIT_UPPER = ("a number in (0, 1]", lambda v, _: 0.0 < v <= 1.0)
_UNIT_LOWER = ("a number in [0, 1)", lambda v, _: 0.0 <= v < 1.0)
_POSITIVE = ("a finite number > 0", lambda v, _: 0.0 < v < math.inf)
_ABOVE_1 = ("a finite number > 1", lambda v, _: 1.0 < v < math.inf)

# The deprecated names' checks, as RuleConfig made them (the second argument is spike_window): a value given by its old
# name fails here, under that name, as it did; SentinelConfig checks the same bounds under the new names.
_SPIKE_CHECKS: dict[str, tuple[Callable[..., Any], str, Callable[[Any, int], bool]]] = {
    "spike_window": (integer, "an integer >= 3", lambda v, _: v >= 3),
    "spike_warmup": (integer, "an integer in [3, spike_window={window}]", lambda v, window: 3 <= v <= window),
    "spike_zscore": (number, *_POSITIVE),
    "spike_ratio": (number, *_ABOVE_1),
    "spike_floor": (number, *_UNIT_LOWER),
}


@dataclass(frozen=True)
class RuleConfig:
    """Which rules run, and their thresholds, validated when built.

    A threshold named after its rule says when that rule fires: ``docs/rules.md#the-rules``; why each default is what
    it is: ``docs/rules.md#why-these-defaults``.

    Attributes:
        enabled: Names of the rules to evaluate (one name or any iterable, stored as a sorted tuple; they run in rule
            order). ``None`` (default): every rule of the callback, i.e. ``RULES`` and the rules passed in its
            ``extensions=``. Empty: no rule runs. Each name must be a built-in rule or one of the callback's extension
            rules: the callback checks them when it is built (:meth:`select`), listing the valid names.
        dead_frac_threshold: ``dead_units`` fires at ``act_dead_frac >=`` this; in ``(0, 1]``.
        vanishing_ratio: ``vanishing_gradient``'s bound on gradient norm over the output end's; in ``(0, 1)``.
        exploding_ratio: ``exploding_gradient``'s bound on that ratio; finite, ``> 1``.
        saturation_level: An output mapped to ``[-1, 1]`` is saturated beyond this magnitude; in ``(0, 1)``.
        saturation_frac: ``saturation`` fires at this guaranteed share of saturated outputs; in ``(0, 1]``.
        spike_growth: ``loss_spike`` names the earliest layer whose scale grew by more than this; finite, ``> 1``.
        overflow_frac_threshold: ``precision_headroom``'s bound on the share of values at risk; in ``[0, 1)``.
        update_ratio_low: ``update_ratio``'s bound on every layer's update-to-weight ratio; in ``(0, 1)``.
        effective_lr_low: ... and on every layer's update over its gradient; finite, ``> 0``.
        input_scale_limit: ``input_scale``'s bound on the first layer's output RMS; finite, ``> 1``.
        input_scale_floor: ... and on the norm of the first Linear/Conv layer's input vectors (a sample's features, a
            convolution's patch), estimated from its weight gradient; in ``(0, 1)``.
        moved_mass_threshold: ``not_updated``'s bound on the share of squared mass that moved; in ``(0, 1]``.
        replica_rtol: ``replica_divergence``'s relative tolerance between processes' parameter norms; in ``[0, 1)``.
        attn_logit_threshold: ``attention_logits`` fires at ``attn_logit_max >=`` this; finite, ``> 0``.
        attn_trend_floor: ... or from this value on, if rising towards the threshold; in ``[0, attn_logit_threshold)``.
        attn_trend_horizon: ... projected to cross it within this many sampled steps; an integer ``>= 1``.
        trend_window: Sampled steps a trend rule needs, and looks back over; an integer ``>= 3``.
        logit_drift_nats: ``logit_drift``'s bound on the move of ``logit_lse_mean`` over the window; finite, ``> 0``.
        drift_loss_tolerance: ... while the loss changed by at most this share; in ``(0, 1)``.
        unbounded_growth: ``unbounded_loss``: the factor the output layer's ``logit_absmax`` grew by; finite, ``> 1``.
        update_jump_ratio: ``update_jump``'s factor above the window's median update ratio; finite, ``> 1``.

    The sentinel's spike-test settings moved to :class:`~lightning_hookdiag.SentinelConfig`. ``spike_window``,
    ``spike_warmup``, ``spike_zscore``, ``spike_ratio`` and ``spike_floor`` are still accepted here (keywords, or keys
    of :meth:`from_mapping`) for one release, with a ``DeprecationWarning`` naming the new field; the callback hands
    them to its sentinel (:meth:`deprecated_sentinel_settings`).

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

    enabled: tuple[str, ...] | None = None
    dead_frac_threshold: float = _setting(0.9, *_UNIT_UPPER)
    vanishing_ratio: float = _setting(1e-3, *_UNIT_OPEN)
    exploding_ratio: float = _setting(1e3, *_ABOVE_1)
    saturation_level: float = _setting(0.9, *_UNIT_OPEN)
    saturation_frac: float = _setting(0.5, *_UNIT_UPPER)
    spike_growth: float = _setting(10.0, *_ABOVE_1)
    overflow_frac_threshold: float = _setting(0.0, *_UNIT_LOWER)
    update_ratio_low: float = _setting(1e-5, *_UNIT_OPEN)
    effective_lr_low: float = _setting(5e-4, *_POSITIVE)
    input_scale_limit: float = _setting(20.0, *_ABOVE_1)
    input_scale_floor: float = _setting(0.1, *_UNIT_OPEN)
    moved_mass_threshold: float = _setting(0.1, *_UNIT_UPPER)
    replica_rtol: float = _setting(1e-6, *_UNIT_LOWER)
    attn_logit_threshold: float = _setting(50.0, *_POSITIVE)
    attn_trend_floor: float = _setting(
        10.0,
        "a number in [0, attn_logit_threshold={attn_logit_threshold:g})",
        lambda v, c: 0.0 <= v < c.attn_logit_threshold,
    )
    attn_trend_horizon: int = _setting(10, "an integer >= 1", lambda v, _: v >= 1)
    trend_window: int = _setting(8, "an integer >= 3", lambda v, _: v >= 3)
    logit_drift_nats: float = _setting(5.0, *_POSITIVE)
    drift_loss_tolerance: float = _setting(0.1, *_UNIT_OPEN)
    unbounded_growth: float = _setting(2.0, *_ABOVE_1)
    update_jump_ratio: float = _setting(5.0, *_ABOVE_1)
    # Deprecated: the sentinel's settings, now SentinelConfig's (DEPRECATED_SPIKE_SETTINGS); kept for one release.
    spike_window: InitVar[int | None] = None
    spike_warmup: InitVar[int | None] = None
    spike_zscore: InitVar[float | None] = None
    spike_ratio: InitVar[float | None] = None
    spike_floor: InitVar[float | None] = None

    def __post_init__(
        self,
        spike_window: int | None,
        spike_warmup: int | None,
        spike_zscore: float | None,
        spike_ratio: float | None,
        spike_floor: float | None,
    ) -> None:
        values = (spike_window, spike_warmup, spike_zscore, spike_ratio, spike_floor)
        old = {name: value for name, value in zip(DEPRECATED_SPIKE_SETTINGS, values, strict=True) if value is not None}
        window = 50 if spike_window is None else spike_window
        for name, value in old.items():
            check, valid, ok = _SPIKE_CHECKS[name]
            old[name] = check(name, value, valid.format(window=window), lambda v, ok=ok: ok(v, window))
        moved = {DEPRECATED_SPIKE_SETTINGS[name]: value for name, value in old.items()}
        for new in moved:
            warnings.warn(
                f"RuleConfig's {_old_name(new)} is deprecated and will be removed in the next release; use"
                f" SentinelConfig.{new} (LayerHealthCallback(sentinel={{'{new}': ...}}))",
                DeprecationWarning,
                stacklevel=3,
            )
        object.__setattr__(self, "_moved", moved)
        given: Any = self.enabled  # as the caller passed it, validated here: None, one name or an iterable of them
        if given is not None:
            try:
                items = [given] if isinstance(given, str) else list(given)
            except TypeError:
                raise ValueError(f"enabled: expected None or rule names, got {given!r}") from None
            if wrong := [r for r in items if not isinstance(r, str)]:
                raise ValueError(f"enabled: expected rule names (strings), got {wrong!r}")
            # Which rules the names name is the callback's to check (select): its extension rules count too.
            object.__setattr__(self, "enabled", tuple(sorted(set(items))))
        # frozen: normalised through object.__setattr__ so that equal configurations compare and hash equal; the
        # numbers are stored as float and int, so that a numpy scalar from a config leaks into neither arithmetic
        # nor checkpoints.
        for f in fields(self)[1:]:
            valid, ok = f.metadata["valid"].format(**vars(self)), f.metadata["ok"]
            object.__setattr__(
                self, f.name, f.metadata["check"](f.name, getattr(self, f.name), valid, lambda v, ok=ok: ok(v, self))
            )

    def deprecated_sentinel_settings(self) -> dict[str, Any]:
        """The sentinel's settings given here by their deprecated names, keyed by their ``SentinelConfig`` field."""
        moved: dict[str, Any] = getattr(self, "_moved", {})
        return dict(moved)

    def select(self, rules: Sequence[Rule]) -> list[Rule]:
        """The rules of ``rules`` (a callback's: the built-ins, then its extensions) that run, in rule order.

        ``enabled=None`` runs every one of them; a name that none of them has is an error.

        Raises:
            ValueError: If ``enabled`` names a rule not in ``rules``; the message lists the valid names.
        """
        if self.enabled is None:
            return by_order(rules)
        names = [r.name for r in rules]
        if unknown := sorted(repr(n) for n in self.enabled if n not in names):
            raise ValueError(f"enabled: unknown rule(s) {', '.join(unknown)}; expected names from {names}")
        return by_order(r for r in rules if r.name in self.enabled)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> RuleConfig:
        """Build a configuration from a plain mapping, e.g. a YAML section; missing keys keep their defaults.

        Args:
            d: Field names to values (``enabled`` as a list of rule names); ``None`` for the defaults.

        Raises:
            ValueError: For an unknown key (the message lists the valid keys, sorted) or an invalid value.

        Example:
            >>> RuleConfig.from_mapping({"exploding_ratio": 1e4, "enabled": ["nonfinite"]})
            RuleConfig(enabled=('nonfinite',), dead_frac_threshold=0.9, vanishing_ratio=0.001, exploding_ratio=10000.0, saturation_level=0.9, saturation_frac=0.5, spike_growth=10.0, overflow_frac_threshold=0.0, update_ratio_low=1e-05, effective_lr_low=0.0005, input_scale_limit=20.0, input_scale_floor=0.1, moved_mass_threshold=0.1, replica_rtol=1e-06, attn_logit_threshold=50.0, attn_trend_floor=10.0, attn_trend_horizon=10, trend_window=8, logit_drift_nats=5.0, drift_loss_tolerance=0.1, unbounded_growth=2.0, update_jump_ratio=5.0)
            >>> RuleConfig.from_mapping({"dead_frac": 0.5})
            Traceback (most recent call last):
            ...
            ValueError: unknown rule setting(s) ['dead_frac']; valid keys: ['attn_logit_threshold', 'attn_trend_floor', 'attn_trend_horizon', 'dead_frac_threshold', 'drift_loss_tolerance', 'effective_lr_low', 'enabled', 'exploding_ratio', 'input_scale_floor', 'input_scale_limit', 'logit_drift_nats', 'moved_mass_threshold', 'overflow_frac_threshold', 'replica_rtol', 'saturation_frac', 'saturation_level', 'spike_growth', 'trend_window', 'unbounded_growth', 'update_jump_ratio', 'update_ratio_low', 'vanishing_ratio']
        """  # noqa: E501
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"rule settings: expected a mapping of setting names to values, got {d!r}")
        valid = sorted(f.name for f in fields(cls))
        if unknown := sorted(str(k) for k in d if k not in valid and k not in DEPRECATED_SPIKE_SETTINGS):
            raise ValueError(f"unknown rule setting(s) {unknown}; valid keys: {valid}")
        return cls(**d)
