"""Health rules: turn one sampled step's pooled statistics into findings, and decide which of them to alert on.

Pure Python on plain floats (no torch, no Lightning), so the rules can be unit-tested by hand and run on the values
of any logger. Every rule reads only the statistics it needs and does nothing when one is absent (the user chose a
subset) or not finite where a finite value is required. :func:`evaluate` lists forward-pass findings before
backward-pass ones, each pass in its own execution order, so that the first finding is the earliest problem's origin;
:class:`AlertState` decides which findings are new.

The rules (:data:`RULES`), their :class:`RuleConfig` fields and defaults, what each finding names, the rationale of
every default threshold, and the blind spots: ``docs/rules.md`` (the sentinel's fields: ``docs/sentinel.md``).

Example:
    >>> values = {"act_nonfinite": {"enc": 0.0, "mid": 12.0, "head": 40.0}}
    >>> [f.message for f in evaluate(values, ["enc", "mid", "head"], ["head", "mid", "enc"], step=7)]
    ['nonfinite: 12 NaN/Inf output elements in mid at step 7 (the first non-finite layer in forward order; 1 more layer after it is also non-finite: head)']
"""  # noqa: E501

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the rules only read a Trip's fields; importing the sentinel at run time would import torch
    from lightning_hookdiag.sentinel import Trip

from lightning_hookdiag import trends
from lightning_hookdiag.names import owning_layer
from lightning_hookdiag.validation import integer, number

__all__ = [
    "EVENT_RULES",
    "LOSS",
    "ROOT",
    "RULES",
    "SATURATING_TYPES",
    "AlertState",
    "Baseline",
    "Finding",
    "ParamFacts",
    "RuleConfig",
    "cut_off",
    "evaluate",
    "format_error",
    "moved_mass_bound",
    "values_from_metrics",
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
    "stale_gradients",
    "input_scale",
    "not_updated",
    "replica_divergence",
    "attention_logits",
    "logit_drift",
    "update_jump",
)
"""Names of the health rules, in the order findings of the same layer are listed."""

EVENT_RULES: frozenset[str] = frozenset({"loss_spike"})
"""Rules whose findings are events of one step (each alerts), not conditions that persist until they clear."""

SATURATING_TYPES: tuple[str, ...] = ("Tanh", "Sigmoid")
"""Module class names the ``saturation`` rule checks."""

PHASES: tuple[str, ...] = ("forward", "backward")

LOSS = "loss"
"""The ``layer`` of a finding about the loss itself rather than about one layer."""

ROOT = "<root>"
"""The ``layer`` of a finding about the LightningModule's own code: a NaN made in its ``forward`` (or, outside every
module's forward, in ``training_step``) between two layers. Module names are relative to the LightningModule, whose
own name would be empty; the angle brackets cannot occur in a module path."""

# Names of the other affected layers listed in a nonfinite message; the count is always complete.
_MAX_LISTED = 3


# ------------------------------------------------------------------------------------------------------ config
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
            "update_jump_ratio": ("a finite number > 1", lambda v: 1.0 < v < math.inf),
        }
        for name, (valid, ok) in checks.items():
            object.__setattr__(self, name, number(name, getattr(self, name), valid, ok))
        integer("spike_window", self.spike_window, "an integer >= 3", lambda v: v >= 3)
        window = self.spike_window
        integer(
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
        integer("attn_trend_horizon", self.attn_trend_horizon, "an integer >= 1", lambda v: v >= 1)
        integer("trend_window", self.trend_window, "an integer >= 3", lambda v: v >= 3)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> RuleConfig:
        """Build a configuration from a plain mapping, e.g. a YAML section; missing keys keep their defaults.

        Args:
            d: Field names to values (``enabled`` as a list of rule names); ``None`` for the defaults.

        Raises:
            ValueError: For an unknown key (the message lists the valid keys, sorted) or an invalid value.

        Example:
            >>> RuleConfig.from_mapping({"exploding_ratio": 1e4, "enabled": ["nonfinite"]})
            RuleConfig(enabled=('nonfinite',), dead_frac_threshold=0.9, vanishing_ratio=0.001, exploding_ratio=10000.0, saturation_level=0.9, saturation_frac=0.5, spike_window=50, spike_warmup=20, spike_zscore=8.0, spike_ratio=10.0, spike_growth=10.0, overflow_frac_threshold=0.0, update_ratio_low=1e-05, effective_lr_low=0.0005, input_scale_limit=20.0, moved_mass_threshold=0.1, replica_rtol=1e-06, attn_logit_threshold=50.0, attn_trend_floor=10.0, attn_trend_horizon=10, trend_window=8, logit_drift_nats=5.0, drift_loss_tolerance=0.1, update_jump_ratio=5.0)
            >>> RuleConfig.from_mapping({"dead_frac": 0.5})
            Traceback (most recent call last):
            ...
            ValueError: unknown rule setting(s) ['dead_frac']; valid keys: ['attn_logit_threshold', 'attn_trend_floor', 'attn_trend_horizon', 'dead_frac_threshold', 'drift_loss_tolerance', 'effective_lr_low', 'enabled', 'exploding_ratio', 'input_scale_limit', 'logit_drift_nats', 'moved_mass_threshold', 'overflow_frac_threshold', 'replica_rtol', 'saturation_frac', 'saturation_level', 'spike_growth', 'spike_ratio', 'spike_warmup', 'spike_window', 'spike_zscore', 'trend_window', 'update_jump_ratio', 'update_ratio_low', 'vanishing_ratio']
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


# ----------------------------------------------------------------------------------------------------- finding
@dataclass(frozen=True)
class Finding:
    """One rule firing for one layer on one step.

    Attributes:
        rule: Name from :data:`RULES`.
        layer: The layer (module name) the finding is about; for findings about parameters, the parameter's
            module: the longest layer of ``forward_order``/``backward_order`` that prefixes its dotted name, else the
            name minus its last segment. :data:`LOSS` for the loss itself; for a NaN made by functional code between
            two layers, the module whose forward made it (not necessarily selected), or :data:`ROOT`.
            ``exploding_gradient``: the layer whose backward amplifies the gradient most; ``no_gradient``: the first
            cut-off layer in forward order; ``eval_mode``: the first module in eval mode in forward order (a
            BatchNorm or Dropout, selected or not).
        step: The optimizer step the statistics describe.
        value: The observed value compared with ``threshold``: a count of non-finite elements or parameters
            (``nonfinite``), a dead fraction, a gradient-norm ratio, a lower bound on the saturated share, the
            number of cut-off layers (``no_gradient``) or of modules in eval mode (``eval_mode``), the largest bound
            on the moved share of a module's parameters (``not_updated``; for parameters no optimizer holds, their
            largest gradient norm), the largest relative spread of norms (``replica_divergence``).
        threshold: The threshold it crossed (``0.0`` for ``nonfinite``: any count above it fires).
        message: Human-readable sentence naming the rule and the layer.
        phase: ``"forward"`` (about activations) or ``"backward"`` (about gradients).
        stat: The statistic that triggered it (``act_nonfinite``, ``act_grad_nonfinite``, ``param_grad_norm``,
            ``param_norm`` (non-finite weights, replicas that differ), ``act_dead_frac``, ``act_grad_norm``,
            ``act_std``, ``act_absmax``, ``param_update_ratio`` (weights that did not move; ``param_grad_norm``
            for parameters no optimizer holds), ``training`` (``eval_mode``: the module's mode), or ``loss`` for a
            finding about the loss itself), e.g. to ignore non-finite gradients on steps that an fp16 ``GradScaler``
            skips.
    """

    rule: str
    layer: str
    step: int
    value: float
    threshold: float
    message: str
    phase: str
    stat: str

    def __str__(self) -> str:
        return self.message


class _Orders:
    """Positions of layers in forward and backward order, with documented fallbacks for layers missing from one."""

    def __init__(self, forward_order: Sequence[str], backward_order: Sequence[str]) -> None:
        self.forward: dict[str, int] = {}
        for i, name in enumerate(forward_order):
            self.forward.setdefault(name, i)  # a module called twice: its first call is its depth
        self.backward: dict[str, int] = {}
        for i, name in enumerate(backward_order):
            self.backward.setdefault(name, i)
        self.layers = self.forward.keys() | self.backward.keys()

    def place(self, layer: str, like: str) -> None:
        """Sort ``layer``, a module outside the observed order (not selected), at the position of observed ``like``."""
        if like in self.forward:
            self.forward.setdefault(layer, self.forward[like])

    def owner(self, param: str) -> str:
        # A selected container owns "<container>.<child>.<name>": the longest known layer prefix is the module that
        # was observed, not the dotted name minus its last segment.
        return owning_layer(param, self.layers)

    def forward_key(self, layer: str) -> tuple[int, int, str]:
        if layer in self.forward:
            return (0, self.forward[layer], "")
        return (1, 0, layer)  # unknown position: after every known layer, deterministically by name

    def backward_key(self, layer: str) -> tuple[int, int, str]:
        if layer in self.backward:
            return (0, self.backward[layer], "")
        # Without a recorded backward order (no gradient hooks), reversed forward order is exact for a chain of
        # modules and the best available guess otherwise.
        if layer in self.forward:
            return (1, -self.forward[layer], "")
        return (2, 0, layer)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (", ..." if len(names) > _MAX_LISTED else "")


# ------------------------------------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class ParamFacts:
    """Host facts about one tracked parameter on a sampled step, which ``not_updated`` reads beside its statistics.

    Attributes:
        held: Whether an optimizer of the Trainer holds the parameter in one of its param groups.
        applied: Whether an optimizer that holds it ran its step (not skipped by an fp16 ``GradScaler`` for an
            overflow, or by a ``training_step`` that returned ``None``).
        lr: The learning rate it was stepped with (the largest of the groups that hold it); NaN if unknown.
        base_lr: The lr an LR scheduler scales (the group's ``initial_lr``), ``None`` without a scheduler.
        dtype: Name of the weights' dtype, for the message (``"bfloat16"``).
        eps: ``torch.finfo(dtype).eps`` of the weights: the gap between 1 and the next representable number.

    Example:
        >>> ParamFacts(held=True, lr=0.1, dtype="bfloat16", eps=2**-7).eps
        0.0078125
    """

    held: bool
    applied: bool = True
    lr: float = math.nan
    base_lr: float | None = None
    dtype: str = "float32"
    eps: float = 2.0**-23


@dataclass(frozen=True)
class _Context:
    values: Mapping[str, Mapping[str, float]]
    orders: _Orders
    step: int
    config: RuleConfig
    layer_types: Mapping[str, str]
    trip: Trip | None = None
    baseline: Baseline | None = None
    last_finite: Mapping[str, int] | None = None
    missing_grads: Collection[str] = ()
    eval_mode: Mapping[str, str] = field(default_factory=dict)
    param_facts: Mapping[str, ParamFacts] | None = None
    history: trends.History | None = None
    shared: dict[str, Any] = field(default_factory=dict, compare=False)
    """What several rules derive from the same values (both gradient rules sort the same ratios)."""

    def stat(self, name: str) -> Mapping[str, float]:
        return self.values.get(name) or {}


@dataclass(frozen=True)
class Baseline:
    """The values of an earlier, regular sampled step, for rules that compare against the recent past.

    Attributes:
        step: The optimizer step the values describe.
        values: As the ``values`` argument of :func:`evaluate`.
    """

    step: int
    values: Mapping[str, Mapping[str, float]]


def _origin(
    ctx: _Context, bad: Mapping[str, float], phase: str, stat: str, describe: Callable[[str, list[str]], str]
) -> Finding | None:
    """The ``nonfinite`` finding for the earliest of the ``bad`` layers in ``phase`` order, if any.

    ``describe(origin, others)`` writes the message; the value is ``bad[origin]``.
    """
    if not bad:
        return None
    key = ctx.orders.forward_key if phase == "forward" else ctx.orders.backward_key
    origin, *others = sorted(bad, key=key)
    return Finding(
        rule="nonfinite",
        layer=origin,
        step=ctx.step,
        value=float(bad[origin]),
        threshold=0.0,
        message=describe(origin, others),
        phase=phase,
        stat=stat,
    )


def _also(others: Sequence[str], where: str, what: str) -> str:
    if not others:
        return ""
    verb = "is" if len(others) == 1 else "are"
    return f"; {_plural(len(others), 'more layer')}{where} {verb} also {what}: {_listing(others)}"


def _nonfinite(ctx: _Context) -> list[Finding]:
    found = _nonfinite_origins(ctx)
    weights = _nonfinite_weights(ctx)
    if weights is not None:
        # A broken weight makes everything computed from it non-finite: only a forward origin upstream of every
        # broken weight is still an origin of its own (its inputs come from healthy layers).
        first_broken = ctx.orders.forward_key(weights.layer)
        found = [f for f in found if f.phase == "forward" and ctx.orders.forward_key(f.layer) < first_broken]
        found.append(weights)
    trip = ctx.trip
    # A step that was not replayed always says so; a replayed one only when its statistics explain nothing.
    if trip is not None and trip.kind in ("nonfinite_loss", "nonfinite_grad") and not (found and trip.replayed):
        what = "loss" if trip.kind == "nonfinite_loss" else "parameter gradients"
        if trip.replayed:
            detail = (
                "the observed layers' outputs and output gradients stayed finite, so the NaN/Inf arose outside them"
                " (in the loss function, in a module that is not selected, or in a non-deterministic op)"
            )
        else:
            detail = f"not replayed because {trip.reason}; step {ctx.step + 1} is sampled"
        found.append(
            Finding(
                rule="nonfinite",
                layer=LOSS,
                step=ctx.step,
                value=1.0,
                threshold=0.0,
                message=f"nonfinite: non-finite {what} at step {ctx.step}{_last_finite_loss(trip)}; {detail}",
                phase="forward",
                stat="loss",
            )
        )
    return found


def _last_finite_loss(trip: Trip | None) -> str:
    if trip is None or trip.last_finite_step is None:
        return ""
    return f" (the sentinel last saw a finite step at step {trip.last_finite_step})"


def _nonfinite_weights(ctx: _Context) -> Finding | None:
    """A finding naming the parameters whose weights are already NaN/Inf before the step, if any."""
    bad = [
        p for p, norm in ctx.stat("param_norm").items() if isinstance(norm, (int, float)) and not math.isfinite(norm)
    ]
    if not bad:
        return None
    owners = sorted({ctx.orders.owner(p) for p in bad}, key=ctx.orders.forward_key)
    known = [ctx.last_finite[p] for p in bad if ctx.last_finite and p in ctx.last_finite]
    when = f"; they were last observed finite at step {max(known)}" if known else ""
    return Finding(
        rule="nonfinite",
        layer=owners[0],
        step=ctx.step,
        value=float(len(bad)),
        threshold=0.0,
        message=f"nonfinite: the weights are already non-finite before step {ctx.step}: {_listing(bad)}"
        f" ({_plural(len(bad), 'parameter')} in {_plural(len(owners), 'layer')}, the first in forward order:"
        f" {owners[0]}){when}{_last_finite_loss(ctx.trip)}. The weights broke on an earlier step; every activation and"
        " gradient computed from them is non-finite as a consequence and is not blamed on its layer",
        phase="forward",
        stat="param_norm",
    )


def _nonfinite_origins(ctx: _Context) -> list[Finding]:
    step = ctx.step
    # Activations: a NaN propagates forward, so the first non-finite layer in forward order is where it was born.
    acts = {k: v for k, v in ctx.stat("act_nonfinite").items() if _finite(v) and v > 0}
    forward = _origin(
        ctx,
        acts,
        "forward",
        "act_nonfinite",
        lambda origin, others: (
            f"nonfinite: {acts[origin]:.0f} NaN/Inf output elements in {origin} at step {step}"
            f" (the first non-finite layer in forward order{_also(others, ' after it', 'non-finite')})"
        ),
    )
    if forward is not None and ctx.trip is not None and ctx.trip.nan_entry == forward.layer:
        forward = _made_between(ctx, forward)
    # Output gradients: a NaN propagates backward, so the origin is the first non-finite layer in backward order.
    grads = {k: v for k, v in ctx.stat("act_grad_nonfinite").items() if _finite(v) and v > 0}
    backward = _origin(
        ctx,
        grads,
        "backward",
        "act_grad_nonfinite",
        lambda origin, others: (
            f"nonfinite: {grads[origin]:.0f} NaN/Inf elements in the output gradient of {origin}"
            f" at step {step} (the first non-finite output gradient in backward order"
            f"{_also(others, ' after it in backward order', 'affected')})"
        ),
    )
    # Parameter gradients are formed from their module's output gradient, so the same backward-order origin holds.
    by_layer: dict[str, list[tuple[str, float]]] = {}
    for param, norm in ctx.stat("param_grad_norm").items():
        if isinstance(norm, (int, float)) and not math.isfinite(norm):
            by_layer.setdefault(ctx.orders.owner(param), []).append((param, norm))
    params = _origin(
        ctx,
        {layer: float(len(p)) for layer, p in by_layer.items()},
        "backward",
        "param_grad_norm",
        lambda origin, others: (
            f"nonfinite: non-finite parameter gradient norm in {origin} at step {step}"
            f" ({', '.join(f'{p}={n}' for p, n in by_layer[origin])}; the first such layer in backward order"
            f"{_also(others, '', 'affected')})"
        ),
    )
    return [f for f in (forward, backward, params) if f is not None]


def _eval_mode(ctx: _Context) -> list[Finding]:
    if not ctx.eval_mode:
        return []
    given = {name: i for i, name in enumerate(ctx.eval_mode)}
    names = sorted(given, key=lambda n: (*ctx.orders.forward_key(n)[:2], given[n]))
    first, kind = names[0], ctx.eval_mode[names[0]]
    effect = (
        "drops nothing, so the regularisation the model was built with is off"
        if "Dropout" in kind
        else "normalises with its running statistics instead of the batch's and stops updating them"
    )
    others = [f"{n} ({ctx.eval_mode[n]})" for n in names[1:]]
    return [
        Finding(
            rule="eval_mode",
            layer=first,
            step=ctx.step,
            value=float(len(names)),
            threshold=0.0,
            message=f"eval_mode at step {ctx.step}: {first} ({kind}) ran with training=False in a training step while"
            f" the parameters it trains require grad: it {effect}. Is a model.eval() of an inner evaluation left on?"
            f" Call .train() after it{_modules_also(others)}",
            phase="forward",
            stat="training",
        )
    ]


def _modules_also(others: Sequence[str]) -> str:
    if not others:
        return ""
    verb = "is" if len(others) == 1 else "are"
    return f"; {_plural(len(others), 'more module')} {verb} in eval mode too: {_listing(others)}"


def _made_between(ctx: _Context, entry: Finding) -> Finding:
    """The forward ``nonfinite`` finding when the first non-finite layer's input was already non-finite.

    The replay's trace (:mod:`lightning_hookdiag.provenance`) named the innermost module whose forward made the
    NaN/Inf (``trip.nan_origin``), or none: it was made outside every module's forward. The finding names that module
    (:data:`ROOT` for the LightningModule's own code) and sorts where ``entry`` does.
    """
    assert ctx.trip is not None
    first = entry.layer
    position = ctx.orders.forward.get(first, -1)
    earlier = [name for name, p in ctx.orders.forward.items() if p < position]
    previous = max(earlier, key=ctx.orders.forward.__getitem__) if earlier else None
    origin = ctx.trip.nan_origin
    if origin is None:
        where = "outside every module's forward (in training_step, or a function it calls)"
    elif origin == ROOT:
        where = f"inside the LightningModule's own forward ({ROOT})"
    else:
        where = f"inside the forward of {origin}"
    after = f"after the output of {previous} and " if previous is not None else ""
    layer = origin or ROOT
    ctx.orders.place(layer, first)
    return replace(
        entry,
        layer=layer,
        message=f"nonfinite: the NaN/Inf was made {where}, {after}before the input of {first}, at step {ctx.step}:"
        f" functional code there (torch.log, sqrt, a division) made it, not a selected layer. {first}, the first"
        f" non-finite selected layer in forward order, received it ({entry.value:.0f} NaN/Inf output elements)",
    )


def _dead_units(ctx: _Context) -> list[Finding]:
    threshold = ctx.config.dead_frac_threshold
    return [
        Finding(
            rule="dead_units",
            layer=layer,
            step=ctx.step,
            value=float(frac),
            threshold=threshold,
            message=f"dead_units: {frac:.1%} of the units of {layer} were <= 0 for every sample of step {ctx.step}"
            f" (dead_frac_threshold={threshold:g})",
            phase="forward",
            stat="act_dead_frac",
        )
        for layer, frac in ctx.stat("act_dead_frac").items()
        # NaN (a layer whose units are not tracked) compares False and is skipped with the rest.
        if _finite(frac) and frac >= threshold
    ]


def cut_off(
    missing_grads: Collection[str],
    forward_order: Sequence[str],
    backward_order: Sequence[str],
    param_grad_norm: Mapping[str, float] | None = None,
) -> list[str]:
    """The layers the gradient never reached on its way to the input end, in forward order (``no_gradient``).

    A layer is cut off when its output required grad but received no gradient (``missing_grads``) and it ran
    before the first layer, in forward order, that did receive one (``backward_order``), and none of the parameters
    it owns received a non-zero gradient (``param_grad_norm``, when known). A layer that ran *after* some layer that
    received a gradient is a branch that does not reach the loss by design (BERT's pooler under a token-level head,
    an auxiliary output): the network before it learns, so it is not reported; nor is anything when no layer
    received a gradient (no backward ran). The parameter check covers modules that return a tuple: only the first
    floating-point output is watched, and an ``nn.LSTM`` whose ``h_n`` alone feeds the head still learns.

    Example:
        >>> cut_off({"body.0", "body.1", "pool"}, ["body.0", "body.1", "head", "pool"], ["head"])
        ['body.0', 'body.1']
        >>> cut_off({"lstm"}, ["lstm", "head"], ["head"], {"lstm.weight_hh_l0": 0.3})
        []
    """
    forward = {}
    for i, name in enumerate(forward_order):
        forward.setdefault(name, i)
    reached = [forward[n] for n in backward_order if n in forward]
    if not reached:
        return []
    first = min(reached)
    learning = set()
    if param_grad_norm:
        layers = set(forward)
        learning = {owning_layer(p, layers) for p, norm in param_grad_norm.items() if _finite(norm) and norm > 0}
    return sorted(
        (n for n in missing_grads if forward.get(n, first) < first and n not in learning), key=forward.__getitem__
    )


def _no_gradient(ctx: _Context) -> list[Finding]:
    forward = sorted(ctx.orders.forward, key=ctx.orders.forward.__getitem__)
    backward = sorted(ctx.orders.backward, key=ctx.orders.backward.__getitem__)
    cut = cut_off(ctx.missing_grads, forward, backward, ctx.stat("param_grad_norm"))
    if not cut:
        return []
    first, last = cut[0], cut[-1]
    reached = min((n for n in backward if n in ctx.orders.forward), key=ctx.orders.forward.__getitem__)
    return [
        Finding(
            rule="no_gradient",
            layer=first,
            step=ctx.step,
            value=float(len(cut)),
            threshold=0.0,
            message=f"no_gradient at step {ctx.step}: the output of {first} required grad but received no gradient,"
            f" while {reached}, later in forward order, did: the gradient stops between {last} and {reached} (a"
            f" .detach(), or an output that does not reach the loss), so {first} and what runs before the cut do not"
            f" learn{_also(cut[1:], ' after it', 'cut off')}",
            phase="backward",
            stat="act_grad_norm",
        )
    ]


def _gradient_ratios(ctx: _Context) -> tuple[str, float, list[tuple[str, float]]] | None:
    """The output-end reference layer and norm, and every other usable layer's ratio to it, in backward order."""
    if "gradient_ratios" not in ctx.shared:
        ctx.shared["gradient_ratios"] = _compute_gradient_ratios(ctx)
    return ctx.shared["gradient_ratios"]


def _compute_gradient_ratios(ctx: _Context) -> tuple[str, float, list[tuple[str, float]]] | None:
    nonfinite = ctx.stat("act_grad_nonfinite")
    # A norm taken over only the finite part of a NaN-ridden gradient means nothing; `nonfinite` reports those.
    usable = [
        (layer, float(norm))
        for layer, norm in ctx.stat("act_grad_norm").items()
        if _finite(norm) and norm >= 0 and not (_finite(nonfinite.get(layer, 0.0)) and nonfinite.get(layer, 0.0) > 0)
    ]
    usable.sort(key=lambda item: ctx.orders.backward_key(item[0]))
    for i, (layer, norm) in enumerate(usable):
        if norm > 0:
            return layer, norm, [(name, n / norm) for name, n in usable[i + 1 :]]
    return None


def _input_side(rest: Sequence[tuple[str, float]], vanishing: bool) -> list[tuple[float, str]]:
    """For each layer of ``rest`` (backward order), the extreme ratio over it and every layer after it.

    Vanishing takes the largest ratio from a layer to the input end: the gradient signal is lost there only if no
    layer between it and the input still receives it (a residual stream carries it past q/k projections and
    zero-initialised branches). Exploding takes the smallest positive ratio: it blew up only if every layer from
    there to the input receives a blown-up gradient (an exact 0 is no signal at all, not a small one).
    """
    out: list[tuple[float, str]] = []
    best: tuple[float, str] | None = None
    for layer, ratio in reversed(rest):
        if vanishing:
            if best is None or ratio > best[0]:
                best = (ratio, layer)
        elif ratio > 0 and (best is None or ratio < best[0]):
            best = (ratio, layer)
        out.append(best if best is not None else (math.nan, layer))
    return out[::-1]


def _largest_gain(ref: tuple[str, float], rest: Sequence[tuple[str, float]]) -> tuple[str, str, float, float] | None:
    """Where the output-gradient norm grows most between consecutive layers in backward order (zeros skipped).

    Returns ``(layer, next_layer, gain, median of the other gains)``: ``next_layer``'s norm over ``layer``'s, the
    largest such ratio from the output end to the input end. In a chain, the gradient at ``next_layer``'s output is
    what ``layer``'s backward (and that of any unobserved module between them) makes of ``layer``'s output gradient,
    so ``layer`` is where the gradient is amplified. ``None`` with fewer than two positive norms.
    """
    chain = [ref, *((layer, norm) for layer, norm in rest if norm > 0)]
    gains = [(after[1] / before[1], before[0], after[0]) for before, after in zip(chain[:-1], chain[1:], strict=True)]
    if not gains:
        return None
    best = max(range(len(gains)), key=lambda i: gains[i][0])
    gain, layer, nxt = gains[best]
    others = [g for i, (g, _, _) in enumerate(gains) if i != best]
    return layer, nxt, gain, statistics.median(others) if others else math.nan


def _amplifier(ref_layer: str, rest: Sequence[tuple[str, float]], fired: str) -> tuple[str, str]:
    """``exploding_gradient``'s layer and the sentence saying where and how much the gradient grows.

    ``rest``: every other layer's ratio to the output end (``ref_layer``), in backward order; ``fired``: the layer
    from which the rule fired. Only the growth up to ``fired`` made it fire, so the gains are measured from the output
    end to ``fired``. The layer with the largest gain is named when it holds at least half of the orders of magnitude
    gained there (the growth happens in one place, as in a recurrent module); when the growth is spread over many
    layers (every block of a badly initialised stack amplifies a little), no layer is *the* amplifier and ``fired``,
    the first layer past the threshold, is named, with the largest gain in the message.
    """
    names = [layer for layer, _ in rest]
    upto = rest[: names.index(fired) + 1] if fired in names else list(rest)
    found = _largest_gain((ref_layer, 1.0), upto)  # ratios to the output end: the same gains as the norms
    if found is None:
        return fired, ""
    layer, nxt, gain, median = found
    # The growth from the output end to the fired layer, in orders of magnitude: the share the largest step holds.
    total = max(ratio for _, ratio in upto)
    share = min(1.0, math.log(gain) / math.log(total)) if gain > 1 and _finite(total) and total > 1 else math.nan
    others = (
        "" if not _finite(median) else f"; the median of the other gains between consecutive layers is {median:.3g}"
    )
    part = "" if not _finite(share) else f", {share:.0%} of the orders of magnitude gained from the output end"
    gains = (
        f"{nxt}'s output gradient, the next observed one in backward order, is {gain:.3g} times {layer}'s (a layer"
        f" that keeps the gradient's scale has a gain near 1){part}{others}"
    )
    if _finite(share) and share >= 0.5:
        return layer, f". The gradient grows most in the backward of {layer}: {gains}"
    return fired, f". The growth is spread over the layers up to {fired}, none holding most of it; the largest: {gains}"


def _gradient_scale(ctx: _Context, rule: str) -> list[Finding]:
    ratios = _gradient_ratios(ctx)
    if ratios is None:
        return []
    ref_layer, ref_norm, rest = ratios
    vanishing = rule == "vanishing_gradient"
    threshold = ctx.config.vanishing_ratio if vanishing else ctx.config.exploding_ratio
    for i, ((layer, _), (ratio, extreme)) in enumerate(zip(rest, _input_side(rest, vanishing), strict=True)):
        if (ratio < threshold) if vanishing else (ratio > threshold):
            span = f"from {layer} to the input end ({_plural(len(rest) - i, 'layer')})"
            what = (
                f"no layer {span} receives an output gradient of vanishing_ratio={threshold:g} times that of the output"
                f" end ({ref_layer}, {ref_norm:.3g}); the largest is {ratio:.3g} times, at {extreme}"
                if vanishing
                else f"every layer {span} receives an output gradient more than exploding_ratio={threshold:g} times"
                f" that of the output end ({ref_layer}, {ref_norm:.3g}); the smallest is {ratio:.3g} times, at"
                f" {extreme}"
            )
            named = layer
            if not vanishing:  # named where the gradient grows, not where the growth is first seen
                named, where = _amplifier(ref_layer, rest, layer)
                what += where
            return [
                Finding(
                    rule=rule,
                    layer=named,
                    step=ctx.step,
                    value=ratio,
                    threshold=threshold,
                    message=f"{rule} at step {ctx.step}: {what}",
                    phase="backward",
                    stat="act_grad_norm",
                )
            ]
    return []


def _saturation(ctx: _Context) -> list[Finding]:
    level, frac = ctx.config.saturation_level, ctx.config.saturation_frac
    means, stds = ctx.stat("act_mean"), ctx.stat("act_std")
    out: list[Finding] = []
    for layer, kind in ctx.layer_types.items():
        kind = kind.rpartition(".")[2]  # accept "torch.nn.Tanh" as well as "Tanh"
        mean, std = means.get(layer, math.nan), stds.get(layer, math.nan)
        if kind not in SATURATING_TYPES or not (_finite(mean) and _finite(std)):
            continue
        # Second moment of z in [-1, 1]: z = y for Tanh, z = 2y - 1 for Sigmoid.
        m2 = std * std + mean * mean if kind == "Tanh" else 4 * std * std + (2 * mean - 1) ** 2
        bound = min(1.0, max(0.0, (m2 - level * level) / (1 - level * level)))
        if bound >= frac:
            z = "|y|" if kind == "Tanh" else "|2y - 1|"
            out.append(
                Finding(
                    rule="saturation",
                    layer=layer,
                    step=ctx.step,
                    value=bound,
                    threshold=frac,
                    message=f"saturation: at least {bound:.1%} of the outputs of {layer} ({kind}) have {z} >"
                    f" {level:g} at step {ctx.step} (from act_mean={mean:.3g}, act_std={std:.3g}; saturation_frac="
                    f"{frac:g}): their local gradient is below {1 - level * level:.0%} of its maximum",
                    phase="forward",
                    stat="act_std",
                )
            )
    return out


def _activation_scale(values: Mapping[str, Mapping[str, float]]) -> tuple[str, dict[str, float]]:
    """Per-layer activation scale: RMS of the finite outputs from act_mean/act_std, else act_absmax."""
    means, stds = values.get("act_mean") or {}, values.get("act_std") or {}
    if means and stds:
        rms = {k: math.sqrt(means[k] ** 2 + stds[k] ** 2) for k in means.keys() & stds.keys()}
        return "act_std", {k: v for k, v in rms.items() if _finite(v)}
    return "act_absmax", {k: v for k, v in (values.get("act_absmax") or {}).items() if _finite(v)}


def _loss_spike(ctx: _Context) -> list[Finding]:
    trip = ctx.trip
    if trip is None or trip.kind != "loss_spike":
        return []
    growth_limit = ctx.config.spike_growth
    against = "" if trip.baseline is None else f" the median of recent steps ({trip.baseline:.3g})"
    factor = (
        f" is {trip.loss / trip.baseline:.3g}x{against}"
        if trip.baseline and trip.baseline > 0
        else f" rose far above{against or ' its recent values'}"
    )
    head = f"loss_spike: the loss {trip.loss:.3g} at step {ctx.step}{factor}"
    stat, layer, growth = "loss", LOSS, math.nan
    if not trip.replayed:
        tail = f"; not replayed because {trip.reason}; step {ctx.step + 1} is sampled"
    elif ctx.baseline is None:
        tail = "; no earlier sampled step to compare the layers with"
    else:
        stat, now = _activation_scale(ctx.values)
        _, before = _activation_scale(ctx.baseline.values)
        grown = [
            (name, now[name] / before[name])
            for name in sorted(now.keys() & before.keys(), key=ctx.orders.forward_key)
            if before[name] > 0 and now[name] > growth_limit * before[name]
        ]
        if grown:
            layer, growth = grown[0]
            tail = (
                f"; the activation scale of {layer} grew {growth:.3g}x since step {ctx.baseline.step}, the first layer"
                f" in forward order to grow more than spike_growth={growth_limit:g}"
                f"{_also([n for n, _ in grown[1:]], ' after it', 'grown')}"
            )
        else:
            stat = "loss"
            tail = (
                f"; no observed layer's activation scale grew more than spike_growth={growth_limit:g} since step"
                f" {ctx.baseline.step}, so the spike comes from the targets or the loss, not from the network"
                " (inputs far off their usual scale would have grown the first layer)"
            )
    return [
        Finding(
            rule="loss_spike",
            layer=layer,
            step=ctx.step,
            value=float(growth if layer != LOSS else trip.loss),
            threshold=growth_limit if layer != LOSS else (trip.baseline or 0.0),
            message=head + tail,
            phase="forward",
            stat=stat,
        )
    ]


# The opt-in precision statistics are logged per target dtype: "<base>_<target>".
_OVERFLOW_STATS = (("act_grad_overflow_frac_", "backward"), ("act_overflow_frac_", "forward"))


def _precision_headroom(ctx: _Context) -> list[Finding]:
    threshold = ctx.config.overflow_frac_threshold
    out: list[Finding] = []
    for stat, per_layer in ctx.values.items():
        for head, phase in _OVERFLOW_STATS:
            if not stat.startswith(head):
                continue
            target = stat[len(head) :]
            what = "outputs" if phase == "forward" else "output gradients"
            for layer, frac in per_layer.items():
                if _finite(frac) and frac > threshold:
                    out.append(
                        Finding(
                            rule="precision_headroom",
                            layer=layer,
                            step=ctx.step,
                            value=float(frac),
                            threshold=threshold,
                            message=f"precision_headroom: {frac:.3g} of the non-zero {what} of {layer} at step"
                            f" {ctx.step} would overflow {target} or sit within 2x of its maximum"
                            f" (overflow_frac_threshold={threshold:g})",
                            phase=phase,
                            stat=stat,
                        )
                    )
            break
    return out


def _layer_updates(orders: _Orders, values: Mapping[str, Mapping[str, float]]) -> dict[str, tuple[float, float]]:
    """Per layer, ``(||dw|| / ||w||, ||dw|| / ||g||)`` over all of its tracked parameters together.

    ``dw`` is the update across the optimizer step, ``g`` the gradient; the second ratio is the learning rate the
    step effectively applied (SGD's ``lr``). Pooled from each parameter's ``param_update_ratio``, ``param_norm`` and
    ``param_grad_norm``. Left out: a layer whose weights are all exactly 0 (a zero-initialised norm), and one whose
    gradient is exactly 0 (a branch behind a zero-initialised norm), which moves by weight decay alone (``lr *
    weight_decay``, 1e-5 with AdamW's defaults at lr 1e-3).
    """
    ratios, norms = values.get("param_update_ratio") or {}, values.get("param_norm") or {}
    grads = values.get("param_grad_norm") or {}
    update_sq: dict[str, float] = {}
    weight_sq: dict[str, float] = {}
    grad_sq: dict[str, float] = {}
    for param, ratio in ratios.items():
        norm, grad = norms.get(param, math.nan), grads.get(param, math.nan)
        if _finite(ratio) and _finite(norm) and _finite(grad) and ratio >= 0:
            layer = orders.owner(param)
            update_sq[layer] = update_sq.get(layer, 0.0) + (ratio * norm) ** 2
            weight_sq[layer] = weight_sq.get(layer, 0.0) + norm * norm
            grad_sq[layer] = grad_sq.get(layer, 0.0) + grad * grad
    return {
        layer: (math.sqrt(update_sq[layer] / w), math.sqrt(update_sq[layer] / grad_sq[layer]))
        for layer, w in weight_sq.items()
        if w > 0 and grad_sq[layer] > 0
    }


def _slow_layers(ctx: _Context, values: Mapping[str, Mapping[str, float]]) -> dict[str, tuple[float, float]] | None:
    """The layers' updates if every layer that moved at all is slow (see ``update_ratio``), else ``None``."""
    low, lr_low = ctx.config.update_ratio_low, ctx.config.effective_lr_low
    # Exactly 0 is no update at all (a parameter outside every optimizer group, lr 0 in a warm-up): not a low one.
    moved = {k: u for k, u in _layer_updates(ctx.orders, values).items() if u[0] > 0}
    if moved and all(ratio < low and lr < lr_low for ratio, lr in moved.values()):
        return moved
    return None


def _update_ratio(ctx: _Context) -> list[Finding]:
    if ctx.baseline is None:
        return []
    # The whole network, not one layer: a norm layer's weights of 1 move by at most about lr per step under Adam,
    # so one layer alone is below 1e-5 in healthy fine-tuning. And small against the gradient too: in a converged
    # fit the weights stop moving because the gradient is small, not the learning rate.
    now, before = _slow_layers(ctx, ctx.values), _slow_layers(ctx, ctx.baseline.values)
    if now is None or before is None:
        return []
    low, lr_low = ctx.config.update_ratio_low, ctx.config.effective_lr_low
    layers = sorted(now, key=ctx.orders.forward_key)
    fastest = max(now, key=lambda k: now[k][0])
    ratio, lr = now[fastest]
    slow = f"by less than update_ratio_low={low:g} of their norm at step {ctx.step} and at step {ctx.baseline.step}"
    where = f"the most, {ratio:.3g}, in {fastest}; the first layer in forward order: {layers[0]}"
    message = (
        f"update_ratio: the optimizer step changed the weights of every one of the {_plural(len(now), 'layer')}"
        f" that got a gradient {slow} ({where}), and by less than effective_lr_low={lr_low:g} times their gradient"
        f" ({lr:.3g} in {fastest}): the learning rate is too low for the weights to move"
    )
    return [
        Finding(
            rule="update_ratio",
            layer=layers[0],
            step=ctx.step,
            value=ratio,
            threshold=low,
            message=message,
            phase="forward",
            stat="param_update_ratio",
        )
    ]


def _stale_gradients(ctx: _Context) -> list[Finding]:
    # A parameter that no optimizer holds keeps its gradient because zero_grad() never clears it: not_updated names
    # that cause exactly, so it is left to that rule when it runs.
    facts = ctx.param_facts if "not_updated" in ctx.config.enabled and ctx.param_facts else {}
    stale = {
        p: norm
        for p, norm in ctx.stat("param_stale_grad_norm").items()
        if isinstance(norm, (int, float))
        and not isinstance(norm, bool)
        and norm != 0  # NaN is stale too
        and (p not in facts or facts[p].held)
    }
    if not stale:
        return []
    owners = sorted({ctx.orders.owner(p) for p in stale}, key=ctx.orders.forward_key)
    first = [p for p in stale if ctx.orders.owner(p) == owners[0]]
    return [
        Finding(
            rule="stale_gradients",
            layer=owners[0],
            step=ctx.step,
            value=float(len(stale)),
            threshold=0.0,
            message=f"stale_gradients: at the first backward of step {ctx.step}, {_plural(len(stale), 'parameter')}"
            f" already held a non-zero gradient ({_listing(first)} in {owners[0]}, the first of"
            f" {_plural(len(owners), 'layer')} in forward order; norm {stale[first[0]]:.3g}): .grad was not zeroed"
            " after the last optimizer step, so the gradients of all past steps add up. Either zero_grad() is not"
            " called (manual optimization), or these parameters are in none of the optimizer's param groups, which"
            " zero_grad() clears",
            phase="backward",
            stat="param_stale_grad_norm",
        )
    ]


def _input_scale(ctx: _Context) -> list[Finding]:
    # Only while the weights are those the fit started from (no earlier sampled step): later, a first layer whose
    # weights blew up (a learning rate too high) has a large output RMS from perfectly scaled inputs.
    if ctx.baseline is not None:
        return []
    limit = ctx.config.input_scale_limit
    stat, scale = _activation_scale(ctx.values)
    ran = [layer for layer in scale if layer in ctx.orders.forward]
    if not ran:
        return []
    first = min(ran, key=ctx.orders.forward_key)
    if not scale[first] > limit:
        return []
    return [
        Finding(
            rule="input_scale",
            layer=first,
            step=ctx.step,
            value=scale[first],
            threshold=limit,
            message=f"input_scale: the outputs of {first}, the first layer in forward order, have an RMS of"
            f" {scale[first]:.3g} at step {ctx.step}, the first sampled step of the fit (input_scale_limit={limit:g}):"
            " its inputs are likely far from unit scale (raw 0-255 pixels, unnormalised features); scale them to"
            " mean 0 and std 1",
            phase="forward",
            stat=stat,
        )
    ]


def moved_mass_bound(ratio: float, eps: float) -> float:
    """Upper bound on the share of a weight's squared mass held by the entries that changed across a step.

    An entry that changes moves by at least one unit in the last place, ``>= (eps / 2) |w_i|``, so the changed
    entries' squared mass is at most ``||dw||**2 / (eps / 2)**2``
    (``docs/rules.md#not_updated-why-a-parameter-did-not-move``).

    Args:
        ratio: ``param_update_ratio``, ``||dw|| / ||w||``, ``>= 0``.
        eps: ``torch.finfo(dtype).eps`` of the weights.

    Example:
        >>> moved_mass_bound(0.0, 2**-7), moved_mass_bound(2**-10, 2**-7), moved_mass_bound(1e-3, 2**-23)
        (0.0, 0.0625, 1.0)
    """
    return min(1.0, (2.0 * ratio / eps) ** 2)


_SCHEDULED_LOW = 1e-2
"""``not_updated`` does not report rounding while a scheduler holds the lr below this share of its base lr."""

# Why a parameter did not move, in the order a module's finding names them.
_UNHELD, _LR_ZERO, _ROUNDED = "unheld", "lr_zero", "rounded"


_FLOAT32_EPS = 2.0**-23


def _stuck(facts: ParamFacts, bound: float | None, intended: float, threshold: float) -> str | None:
    """Why a parameter with a finite, non-zero gradient did not move, or ``None``.

    Args:
        facts: What the host knows about its step.
        bound: :func:`moved_mass_bound` of its update ratio; ``None`` if not measured.
        intended: ``lr * param_grad_norm / param_norm``, the update ratio of a plain SGD step (NaN if unknown).
        threshold: ``moved_mass_threshold``.
    """
    if not facts.held:  # measured anyway: a weight that moved (changed by hand) is not reported
        return _UNHELD if bound is None or bound < threshold else None
    if not facts.applied or bound is None or bound >= threshold:
        return None
    if facts.lr == 0.0:
        # A scheduler at lr 0 (a warm-up from 0, the end of a decay) raises it again, unless it scales a base of 0.
        return _LR_ZERO if not facts.base_lr else None
    if facts.base_lr is not None and facts.lr < _SCHEDULED_LOW * facts.base_lr:
        return None
    # Rounding loses an update that float32 master weights would keep: weights coarser than float32, and a step meant
    # to move them (plain SGD's lr x gradient at least half a float32 ulp; a converged parameter's residual gradient
    # asks for no change). `not >=` is also true for NaN: an unknown lr or weight norm.
    if not (facts.eps > _FLOAT32_EPS and intended >= _FLOAT32_EPS / 2):
        return None
    return _ROUNDED


def _not_updated(ctx: _Context) -> list[Finding]:
    facts = ctx.param_facts
    if not facts:
        return []
    threshold = ctx.config.moved_mass_threshold
    ratios, norms = ctx.stat("param_update_ratio"), ctx.stat("param_norm")
    stuck: dict[str, dict[str, list[tuple[str, float]]]] = {}  # owner -> cause -> [(parameter, value)]
    for param, grad in ctx.stat("param_grad_norm").items():
        fact = facts.get(param)
        if fact is None or not (_finite(grad) and grad > 0):
            continue
        ratio = ratios.get(param)
        bound = moved_mass_bound(ratio, fact.eps) if _finite(ratio) and ratio >= 0 else None
        norm = norms.get(param, math.nan)
        intended = fact.lr * grad / norm if _finite(norm) and norm > 0 else math.nan
        cause = _stuck(fact, bound, intended, threshold)
        if cause is not None:
            value = float(grad) if cause == _UNHELD else float(bound)  # type: ignore[arg-type]
            stuck.setdefault(ctx.orders.owner(param), {}).setdefault(cause, []).append((param, value))
    return [_not_updated_finding(ctx, owner, causes, facts) for owner, causes in stuck.items()]


def _not_updated_finding(
    ctx: _Context, owner: str, causes: dict[str, list[tuple[str, float]]], facts: Mapping[str, ParamFacts]
) -> Finding:
    order = [c for c in (_UNHELD, _LR_ZERO, _ROUNDED) if c in causes]
    unheld = order[0] == _UNHELD  # the finding's value and statistic come from its first cause
    sentences = "; ".join(_stuck_sentence(ctx, cause, causes[cause], facts) for cause in order)
    return Finding(
        rule="not_updated",
        layer=owner,
        step=ctx.step,
        value=max(v for _, v in causes[order[0]]),
        threshold=0.0 if unheld else ctx.config.moved_mass_threshold,
        message=f"not_updated: the weights of {owner} did not move across step {ctx.step}: {sentences}",
        phase="backward",
        stat="param_grad_norm" if unheld else "param_update_ratio",
    )


def _stuck_sentence(ctx: _Context, cause: str, found: list[tuple[str, float]], facts: Mapping[str, ParamFacts]) -> str:
    names = _listing([p for p, _ in found])
    them, their = ("it", "its") if len(found) == 1 else ("them", "their")
    if cause == _UNHELD:
        norms = ", ".join(f"{v:.3g}" for _, v in found[:_MAX_LISTED])
        return (
            f"{names} got a gradient (norm {norms}) but no optimizer of the Trainer holds {them}, so no change was"
            f" applied: add {them} to configure_optimizers, or set requires_grad=False to freeze {them} on purpose"
        )
    if cause == _LR_ZERO:
        return (
            f"{names} did not change although {their} gradient is finite and non-zero: the learning rate of the"
            " param group is 0 and no LR scheduler raises it, so no change was applied"
        )
    first, bound = max(found, key=lambda item: item[1])
    fact = facts[first]
    what = (
        f"did not change at all although the learning rate is {fact.lr:.3g}"
        if bound == 0.0
        else f"changed in almost none of {their} entries (at most {bound:.2%} of the weights' squared mass can have"
        f" changed, from param_update_ratio={ctx.stat('param_update_ratio')[first]:.3g}, eps={fact.eps:.3g} and"
        f" moved_mass_threshold={ctx.config.moved_mass_threshold:g}; lr={fact.lr:.3g})"
    )
    return (
        f"{names} {what}: the update was rounded away in {fact.dtype}, each change being below half a unit in the"
        f" last place of its weight; to fix, keep float32 master weights (precision='bf16-mixed' or '16-mixed') or"
        " raise the learning rate"
    )


def _replica_divergence(ctx: _Context) -> list[Finding]:
    rtol = ctx.config.replica_rtol
    highest = ctx.stat("param_norm")
    apart: dict[str, list[tuple[str, float, float]]] = {}  # owner -> [(parameter, smallest, largest)]
    for param, low in ctx.stat("param_norm_min").items():
        high = highest.get(param)
        if _finite(high) and _finite(low) and high - low > rtol * high:
            apart.setdefault(ctx.orders.owner(param), []).append((param, float(low), float(high)))
    out = []
    for owner, found in apart.items():
        spread = max((high - low) / high for _, low, high in found)
        norms = ", ".join(f"{p} {low:.9g} to {high:.9g}" for p, low, high in found[:_MAX_LISTED])
        out.append(
            Finding(
                rule="replica_divergence",
                layer=owner,
                step=ctx.step,
                value=spread,
                threshold=rtol,
                message=f"replica_divergence: the weights of {owner} differ between processes before step {ctx.step}:"
                f" {_plural(len(found), 'replicated parameter')} {'has' if len(found) == 1 else 'have'} different"
                f" norms on different processes ({norms}{', ...' if len(found) > _MAX_LISTED else ''}; relative"
                f" difference up to {spread:.3g} > replica_rtol={rtol:g}). DDP replicas must be identical: a"
                " rank-dependent update or a weight changed on one process only makes each process train its own"
                " model",
                phase="forward",
                stat="param_norm",
            )
        )
    return out


def _points(ctx: _Context, stat: str, name: str, value: float, keep: int) -> list[tuple[int, float]]:
    """The last ``keep`` kept points of ``stat`` at ``name``, the current value last."""
    earlier = [] if ctx.history is None else [p for p in ctx.history.points(stat, name) if p[0] < ctx.step]
    return [*earlier, (ctx.step, value)][-keep:]


def _window(ctx: _Context, stat: str, name: str, value: float) -> list[tuple[int, float]]:
    """The last ``trend_window`` points of ``stat`` at ``name``, the current value included."""
    return _points(ctx, stat, name, value, ctx.config.trend_window)


def _attention_logits(ctx: _Context) -> list[Finding]:
    config = ctx.config
    limit = config.attn_logit_threshold
    out: list[Finding] = []
    for layer, value in ctx.stat("attn_logit_max").items():
        if not _finite(value):
            continue
        message = ""
        if value >= limit:
            message = (
                f"attention_logits: the largest attention logit |q.k|*scale of {layer} is {value:.4g} at step"
                f" {ctx.step}, at or above attn_logit_threshold={limit:g} (the softmax is close to one-hot; qk-norm"
                " or a lower learning rate keeps it bounded)"
            )
        elif value >= config.attn_trend_floor:
            message = _attention_trend(ctx, layer, value)
        if message:
            out.append(
                Finding("attention_logits", layer, ctx.step, float(value), limit, message, "forward", "attn_logit_max")
            )
    return out


def _attention_trend(ctx: _Context, layer: str, value: float) -> str:
    """The message of a steady rise projected to cross the threshold soon, or ``""``."""
    config = ctx.config
    points = _window(ctx, "attn_logit_max", layer, value)
    if len(points) < config.trend_window or trends.rising_share(points) < 0.75:
        return ""
    crossing = trends.crossing_step(points, config.attn_logit_threshold)
    if crossing is None:
        return ""
    spacing = trends.median([b[0] - a[0] for a, b in zip(points, points[1:], strict=False)])
    if crossing - ctx.step > config.attn_trend_horizon * spacing:
        return ""
    first_step, first = points[0]
    return (
        f"attention_logits: the largest attention logit of {layer} rose from {first:.4g} at step {first_step} to"
        f" {value:.4g} at step {ctx.step} and, at its rate of {trends.log_slope(points):.3g} (log per step), crosses"
        f" attn_logit_threshold={config.attn_logit_threshold:g} at about step {crossing}"
    )


def _span(ctx: _Context, stat: str, name: str, value: float) -> list[tuple[int, float]]:
    """Every kept point of ``stat`` at ``name`` (up to ``4 * trend_window``), the current value last."""
    return _points(ctx, stat, name, value, 4 * ctx.config.trend_window)


def _logit_drift(ctx: _Context) -> list[Finding]:
    config = ctx.config
    loss = ctx.stat("step_loss").get(LOSS)
    out: list[Finding] = []
    if not _finite(loss):
        return out
    losses = dict(_span(ctx, "step_loss", LOSS, float(loss)))
    for layer, value in ctx.stat("logit_lse_mean").items():
        if not _finite(value):
            continue
        points = _span(ctx, "logit_lse_mean", layer, value)
        if len(points) < config.trend_window:
            continue
        # The earliest kept step from which log Z moved far while the loss stayed flat: a slow drift is caught once
        # it has accumulated, over up to 4 * trend_window sampled steps.
        for start, first in points[:-1]:
            old_loss = losses.get(start)
            if old_loss is None:
                continue
            drift, change = value - first, abs(loss - old_loss)
            if abs(drift) >= config.logit_drift_nats and change <= config.drift_loss_tolerance * abs(old_loss):
                out.append(
                    Finding(
                        rule="logit_drift",
                        layer=layer,
                        step=ctx.step,
                        value=drift,
                        threshold=config.logit_drift_nats,
                        message=f"logit_drift: the output logits of {layer} drifted: log Z (logit_lse_mean) moved by"
                        f" {drift:+.3g} nats from step {start} to step {ctx.step} (logit_drift_nats="
                        f"{config.logit_drift_nats:g}) while the loss changed by {change:.3g} (from {old_loss:.4g});"
                        " the softmax does not pin log Z, a z-loss (1e-4 * log Z**2) does",
                        phase="forward",
                        stat="logit_lse_mean",
                    )
                )
                break
    return out


def _layer_update_norms(ctx: _Context) -> dict[str, list[tuple[int, float]]]:
    """Per layer, ``||w_after - w_before||`` over all its parameters on each step of the window, oldest first.

    The update norm is ``param_update_ratio * param_norm``; the current step comes last (if it was measured).
    """
    by_step: dict[str, dict[int, list[float]]] = {}
    params = [p for p in ctx.stat("param_update_ratio") if p in ctx.stat("param_norm")]
    for param in params:
        ratio, norm = ctx.stat("param_update_ratio")[param], ctx.stat("param_norm")[param]
        ratios = dict(_window(ctx, "param_update_ratio", param, ratio)) if _finite(ratio) else {}
        norms = dict(_window(ctx, "param_norm", param, norm)) if _finite(norm) else {}
        steps = by_step.setdefault(ctx.orders.owner(param), {})
        for step, r in ratios.items():
            if step in norms and r >= 0:
                steps.setdefault(step, []).append((r * norms[step]) ** 2)
    out: dict[str, list[tuple[int, float]]] = {}
    for layer, steps in by_step.items():
        if ctx.step in steps:  # a layer whose parameters did not all update now is not compared
            out[layer] = [(s, math.sqrt(sum(sq))) for s, sq in sorted(steps.items())]
    return out


def _update_jump(ctx: _Context) -> list[Finding]:
    config = ctx.config
    jumps: dict[str, tuple[float, float]] = {}
    for layer, points in _layer_update_norms(ctx).items():
        *earlier, (_, now) = points
        if len(earlier) < config.trend_window - 1:
            continue
        own = trends.median([v for _, v in earlier])
        if own > 0:
            jumps[layer] = (now / own, own)
    if not jumps:
        return []
    # A learning-rate schedule (warm-up) moves every layer's update together: compare with the typical jump too.
    typical = trends.median([j for j, _ in jumps.values()])
    out: list[Finding] = []
    for layer, (jump, own) in jumps.items():
        if jump >= config.update_jump_ratio and jump >= config.update_jump_ratio * typical:
            out.append(
                Finding(
                    rule="update_jump",
                    layer=layer,
                    step=ctx.step,
                    value=jump,
                    threshold=config.update_jump_ratio,
                    message=f"update_jump: the optimizer update of {layer} at step {ctx.step} (the norm of its"
                    f" parameters' change) is {jump:.3g}x the median {own:.3g} of its last {config.trend_window - 1}"
                    f" sampled updates (update_jump_ratio={config.update_jump_ratio:g}; the median layer's is"
                    f" {typical:.3g}x), a precursor of a loss spike",
                    phase="backward",
                    stat="param_update_ratio",
                )
            )
    return out


_RULE_FUNCTIONS: dict[str, Callable[[_Context], list[Finding]]] = {
    "nonfinite": _nonfinite,
    "loss_spike": _loss_spike,
    "eval_mode": _eval_mode,
    "dead_units": _dead_units,
    "no_gradient": _no_gradient,
    "vanishing_gradient": lambda ctx: _gradient_scale(ctx, "vanishing_gradient"),
    "exploding_gradient": lambda ctx: _gradient_scale(ctx, "exploding_gradient"),
    "saturation": _saturation,
    "precision_headroom": _precision_headroom,
    "update_ratio": _update_ratio,
    "stale_gradients": _stale_gradients,
    "input_scale": _input_scale,
    "not_updated": _not_updated,
    "replica_divergence": _replica_divergence,
    "attention_logits": _attention_logits,
    "logit_drift": _logit_drift,
    "update_jump": _update_jump,
}


def evaluate(
    values: Mapping[str, Mapping[str, float]],
    forward_order: Sequence[str],
    backward_order: Sequence[str],
    step: int,
    config: RuleConfig | None = None,
    layer_types: Mapping[str, str] | None = None,
    trip: Trip | None = None,
    baseline: Baseline | None = None,
    last_finite: Mapping[str, int] | None = None,
    missing_grads: Collection[str] = (),
    eval_mode: Mapping[str, str] | None = None,
    param_facts: Mapping[str, ParamFacts] | None = None,
    history: trends.History | None = None,
) -> list[Finding]:
    """Apply the enabled rules to one sampled (or sentinel-tripped) step's statistics.

    Args:
        values: Statistic name to ``{layer or parameter name: value}``; any statistic may be absent. Besides the
            logged statistics, ``param_norm_min`` (the smallest ``param_norm`` over processes, where ``param_norm``
            is the largest; replicated parameters of a distributed run) feeds ``replica_divergence``.
        forward_order: Layers in the order their forward first ran (input end first).
        backward_order: Layers in the order their output gradient arrived (output end first). Layers missing from
            it (e.g. no gradient statistics were recorded) are placed after it in reversed forward order.
        step: The optimizer step, copied into each finding.
        config: Rules and thresholds; ``None`` for :class:`RuleConfig` defaults.
        layer_types: Layer to module class name (``"Tanh"``), for ``saturation``; without it that rule is silent.
        trip: What the sentinel saw, when it tripped on this step (``loss_spike`` needs it; ``nonfinite`` uses it).
        baseline: The last regular sampled step's values, which ``loss_spike`` compares against.
        last_finite: Parameter name to the last step its ``param_norm`` was observed finite, for the message about
            non-finite weights.
        missing_grads: Layers whose output required grad but received no gradient on the step, for
            ``no_gradient`` (see :func:`cut_off`).
        eval_mode: BatchNorm and Dropout modules that ran in eval mode in the training step while what they train
            requires grad, to their class names, for ``eval_mode`` (see
            :func:`~lightning_hookdiag.modes.eval_mode_modules`).
        param_facts: Parameter name to what the host knows about its optimizer step, for ``not_updated``; without
            it that rule is silent.
        history: The earlier sampled steps' values, for the trend rules (``attention_logits``' trend,
            ``logit_drift``, ``update_jump``); without it they compare levels only.

    Returns:
        Findings with forward ones (in forward order) before backward ones (in backward order); the first is the
        origin of the earliest problem. Findings of the same layer follow :data:`RULES` order.

    Example:
        >>> values = {"act_grad_norm": {"fc3": 1.0, "fc2": 0.5, "fc1": 2e-4}, "act_dead_frac": {"relu1": 0.95}}
        >>> for f in evaluate(values, ["fc1", "relu1", "fc2", "fc3"], ["fc3", "fc2", "fc1"], step=3):
        ...     print(f.rule, f.layer, f.value)
        dead_units relu1 0.95
        vanishing_gradient fc1 0.0002
    """
    config = RuleConfig() if config is None else config
    orders = _Orders(forward_order, backward_order)
    ctx = _Context(
        values=values,
        orders=orders,
        step=step,
        config=config,
        layer_types=layer_types or {},
        trip=trip,
        baseline=baseline,
        last_finite=last_finite,
        missing_grads=missing_grads,
        eval_mode=eval_mode or {},
        param_facts=param_facts,
        history=history,
    )
    findings = [f for rule in config.enabled for f in _RULE_FUNCTIONS[rule](ctx)]

    def key(f: Finding) -> tuple[Any, ...]:
        position = orders.forward_key(f.layer) if f.phase == "forward" else orders.backward_key(f.layer)
        return (PHASES.index(f.phase), position, RULES.index(f.rule), f.stat)

    return sorted(findings, key=key)


def format_error(findings: Sequence[Finding]) -> str:
    """The message of a :class:`~lightning_hookdiag.LayerHealthError`: the earliest origin first, then the rest.

    Args:
        findings: As returned by :func:`evaluate` (already ordered), not empty.

    Raises:
        ValueError: If ``findings`` is empty.

    Example:
        >>> values = {"act_nonfinite": {"b": 3.0}, "act_dead_frac": {"c": 1.0}}
        >>> print(format_error(evaluate(values, ["a", "b", "c"], [], step=5)))
        layer health check failed at step 5 in b (rule nonfinite): nonfinite: 3 NaN/Inf output elements in b at step 5 (the first non-finite layer in forward order)
        1 more finding:
          - dead_units: 100.0% of the units of c were <= 0 for every sample of step 5 (dead_frac_threshold=0.9)
    """  # noqa: E501
    if not findings:
        raise ValueError("format_error: expected at least one finding, got none")
    first, rest = findings[0], findings[1:]
    lines = [f"layer health check failed at step {first.step} in {first.layer} (rule {first.rule}): {first.message}"]
    if rest:
        lines.append(f"{_plural(len(rest), 'more finding')}:")
        lines += [f"  - {f.message}" for f in rest]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ alerts
class AlertState:
    """Warn once per (rule, layer) until it clears; count every finding per rule.

    A finding is *new* when its (rule, layer) pair was not found on the previously evaluated step. A pair that is
    absent on a later evaluated step clears, and alerts again when it comes back. Findings of the
    :data:`EVENT_RULES` (``loss_spike``) are events, not conditions that persist: every one is new, and none is kept
    as active (two spikes a few steps apart, with no sampled step between them, alert twice). The state is plain
    Python (a set and a dict), so it pickles, and :meth:`state_dict` holds only JSON types for checkpoints.

    Attributes:
        counts: Rule name to the number of findings seen (alerted or not) since the state was created.

    Example:
        >>> state = AlertState()
        >>> dead = evaluate({"act_dead_frac": {"relu": 1.0}}, ["relu"], [], step=0)
        >>> len(state.update(dead)), len(state.update(dead)), len(state.update([])), len(state.update(dead))
        (1, 0, 0, 1)
        >>> state.counts["dead_units"]
        3
        >>> state.state_dict()
        {'active': [['dead_units', 'relu']], 'counts': {'nonfinite': 0, 'loss_spike': 0, 'eval_mode': 0, 'dead_units': 3, 'no_gradient': 0, 'vanishing_gradient': 0, 'exploding_gradient': 0, 'saturation': 0, 'precision_headroom': 0, 'update_ratio': 0, 'stale_gradients': 0, 'input_scale': 0, 'not_updated': 0, 'replica_divergence': 0, 'attention_logits': 0, 'logit_drift': 0, 'update_jump': 0}}
    """  # noqa: E501

    def __init__(self) -> None:
        self._active: set[tuple[str, str]] = set()
        self.counts: dict[str, int] = dict.fromkeys(RULES, 0)

    @property
    def active(self) -> frozenset[tuple[str, str]]:
        """The (rule, layer) pairs found on the last evaluated step."""
        return frozenset(self._active)

    def update(self, findings: Iterable[Finding]) -> list[Finding]:
        """Record one evaluated step's findings and return those to alert on, in their given order.

        Call it once per evaluated step, also with no findings: that is how pairs clear.
        """
        findings = list(findings)
        new: list[Finding] = []
        active: set[tuple[str, str]] = set()
        for f in findings:
            if f.rule in EVENT_RULES:
                new.append(f)
                continue
            pair = (f.rule, f.layer)
            # Also once within a step: a layer can be both a backward origin and a parameter-gradient origin.
            if pair not in self._active and pair not in active:
                new.append(f)
            active.add(pair)
        self._active = active
        for f in findings:
            self.counts[f.rule] = self.counts.get(f.rule, 0) + 1
        return new

    def state_dict(self) -> dict[str, Any]:
        """Active pairs (sorted ``[rule, layer]`` lists) and counts: only JSON types."""
        return {"active": [list(pair) for pair in sorted(self._active)], "counts": dict(self.counts)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (missing keys mean an empty state).

        Raises:
            ValueError: If the state is malformed.
        """
        active = state_dict.get("active", [])
        counts = state_dict.get("counts", {})
        pairs: set[tuple[str, str]] = set()
        for pair in active:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                raise ValueError(f"AlertState.load_state_dict: 'active' expects [rule, layer] pairs, got {pair!r}")
            pairs.add((pair[0], pair[1]))
        if not isinstance(counts, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in counts.items()
        ):
            raise ValueError(f"AlertState.load_state_dict: 'counts' expects {{rule: count >= 0}}, got {counts!r}")
        self._active = pairs
        self.counts = dict.fromkeys(RULES, 0) | dict(counts)


# ----------------------------------------------------------------------------------------------------- helpers
def values_from_metrics(metrics: Mapping[str, float], prefix: str = "layer_health") -> dict[str, dict[str, float]]:
    """Regroup logged keys ``<prefix>/<stat>/<name>`` into the ``values`` argument of :func:`evaluate`.

    Keys without a name (``<prefix>/grad_norm_total``) or outside ``prefix`` are skipped.

    Example:
        >>> values_from_metrics({"layer_health/act_mean/fc1": 0.5, "layer_health/grad_norm_total": 2.0})
        {'act_mean': {'fc1': 0.5}}
    """
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        split = _split_key(key, prefix)
        if split is not None:
            stat, name = split
            group = out.get(stat)
            if group is None:
                group = out[stat] = {}
            group[name] = float(value)
    return out


@functools.lru_cache(maxsize=1 << 16)
def _split_key(key: str, prefix: str) -> tuple[str, str] | None:
    # The same keys come back on every sampled step: parsing them once saves ~0.3 ms per step on 1000 keys.
    head = prefix + "/"
    if not key.startswith(head):
        return None
    stat, sep, name = key[len(head) :].partition("/")
    return (stat, name) if sep and name else None
