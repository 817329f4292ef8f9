"""The callback's grouped settings: what to measure, the sentinel, and what goes out at the end of steps and fits.

Each group is a frozen dataclass validated when built (the message names ``<Class>.<field>``, the bad value and what
is valid), so that a YAML section read by ``LightningCLI`` fails before training starts. The rules' thresholds are
:class:`~lightning_hookdiag.rules.RuleConfig`. :func:`coerce` turns what the callback was given (an object, a
mapping from YAML, or ``None``) into one of these.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from lightning_hookdiag._opt_in import resolve_targets
from lightning_hookdiag._selection import import_types
from lightning_hookdiag._sentinel import SENTINEL_MODES, SpikeDetector
from lightning_hookdiag._validation import boolean, check, choice, integer, module_names, names, number
from lightning_hookdiag._vocabulary import ALL_STATS, OPT_IN_STATS

__all__ = ["MeasureConfig", "OutputConfig", "SentinelConfig", "coerce", "delegate", "regroup", "sentinel_config"]

CHARTS = ("default", "all")


@dataclass(frozen=True)
class MeasureConfig:
    """What is measured on a sampled step, beyond the layers and statistics the callback's own arguments name.

    Args:
        layer_types: Keep only instances of these classes, given as classes or import strings such as
            ``"torch.nn.Linear"``; stored as the classes.
        exclude: Globs of module names to leave out.
        extra_stats: Names added to the callback's ``stats`` (to the default set when ``stats=None``), e.g.
            ``["act_kurtosis"]`` for the defaults plus kurtosis.
        dead_unit_types: Module classes (or import strings) whose outputs get ``act_dead_frac``.
        unit_dim: Axis of the output that indexes units for ``act_dead_frac``. ``None``: dim 1 (channels) for
            4-D/5-D outputs, the last dim for 1-D to 3-D outputs.
        precision_targets: Target dtypes of the precision headroom statistics (``act_underflow_frac`` and friends):
            ``"float16"``, ``"bfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` or torch dtypes. ``None`` derives
            one from the Trainer's ``precision`` (``16-*``: float16, ``bf16-*``: bfloat16; full precision: none, unless
            named here to plan a switch to lower precision).
        output_layer: The module whose output is the model's logits, for ``logit_lse_mean`` / ``logit_absmax`` (a
            dotted name as :func:`~lightning_hookdiag.list_layers` prints it). ``None``: the last selected module to
            run in each micro-batch's forward. Naming one without either statistic in ``stats`` is an error.
        histogram_every_n_steps: Also log histograms of every selected layer's output and output gradient
            (``<prefix>.act_hist/<depth>_<layer>``, ``<prefix>.act_grad_hist/<depth>_<layer>``) on steps divisible by
            this, to the loggers that store histograms (TensorBoard, W&B); other loggers are skipped with a one-time
            note. Must be a multiple of the callback's ``every_n_steps``. ``None``: no histograms.
        histogram_bins: Number of fixed, symmetric log-spaced bins (``±1e-6`` to ``±1e4`` and 0), computed on the
            device; fixed edges make histograms pool exactly over micro-batches and processes. An even integer
            ``>= 4``.
        fast_path: Reduce each output of at least 256 K elements in one compiled pass
            (:class:`~lightning_hookdiag._onepass.OnePass`; ``docs/statistics.md``, "Which path ran and why").
            ``"auto"``: on for CUDA devices when Triton is installed, off on the CPU (compiling costs 3-76 s there, a
            sampled step gains milliseconds); ``"on"``: also on the CPU (needs a C++ compiler), and where it cannot
            run, today's path with one note; ``"off"``: never.

    Raises:
        ValueError: For an invalid field; the message names ``MeasureConfig.<field>``, the value and what is valid.

    Example:
        >>> MeasureConfig(exclude=["head"], unit_dim=1).exclude
        ('head',)
        >>> MeasureConfig(histogram_bins=5)
        Traceback (most recent call last):
        ...
        ValueError: MeasureConfig.histogram_bins: expected an even integer >= 4, got 5
    """

    layer_types: Sequence[str | type[nn.Module]] | None = None
    exclude: Sequence[str] = ()
    extra_stats: Sequence[str] | None = None
    dead_unit_types: Sequence[str | type[nn.Module]] = ("torch.nn.ReLU", "torch.nn.ReLU6")
    unit_dim: int | None = None
    precision_targets: str | torch.dtype | Sequence[str | torch.dtype] | None = None
    output_layer: str | None = None
    histogram_every_n_steps: int | None = None
    histogram_bins: int = 64
    fast_path: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        # Frozen: normalised through object.__setattr__ into hashable, plain values, so that equal configurations
        # compare equal and a numpy scalar from a config reaches neither arithmetic nor checkpoints.
        name = f"{type(self).__name__}."
        given_types = self.layer_types
        layer_types = import_types(given_types, name + "layer_types") if given_types is not None else None
        resolved: dict[str, Any] = {
            "layer_types": layer_types,
            "exclude": tuple(module_names(name + "exclude", self.exclude) or ()),
            "extra_stats": tuple(names(name + "extra_stats", self.extra_stats, ALL_STATS + OPT_IN_STATS, "statistic")),
            "dead_unit_types": import_types(self.dead_unit_types, name + "dead_unit_types"),
            "unit_dim": integer(name + "unit_dim", self.unit_dim, "an integer axis or None", optional=True),
            "precision_targets": _targets(name + "precision_targets", self.precision_targets),
            "output_layer": check(
                name + "output_layer",
                self.output_layer,
                "None or a non-empty module name",
                lambda o: o is None or (isinstance(o, str) and bool(o)),
            ),
            "histogram_every_n_steps": integer(
                name + "histogram_every_n_steps",
                self.histogram_every_n_steps,
                "None or an integer >= 1",
                lambda v: v >= 1,
                optional=True,
            ),
            "histogram_bins": integer(
                name + "histogram_bins", self.histogram_bins, "an even integer >= 4", lambda v: v >= 4 and v % 2 == 0
            ),
            "fast_path": choice(name + "fast_path", self.fast_path, FAST_PATH_CHOICES),
        }
        for key, value in resolved.items():
            object.__setattr__(self, key, value)


def _targets(name: str, value: Any) -> tuple[str, ...] | None:
    """``precision_targets`` resolved, its error naming the field."""
    try:
        return resolve_targets(value)
    except ValueError as error:
        # Its message starts with the old argument's name; the field's replaces it.
        raise ValueError(name + str(error).removeprefix("precision_targets")) from None


FAST_PATH_CHOICES = ("auto", "on", "off")
"""The values of :attr:`MeasureConfig.fast_path`."""


@dataclass(frozen=True)
class SentinelConfig:
    """The always-on sentinel: what it checks on every optimizer step, and its loss-spike test (``docs/sentinel.md``).

    Args:
        mode: ``"loss"`` (NaN/Inf or a spike in the loss), ``"loss+grads"`` (also NaN/Inf in the selected
            parameters' gradients) or ``None`` (no sentinel).
        window: The loss baseline, in healthy steps; an integer ``>= 3``.
        warmup: Healthy steps before a spike can trip; an integer in ``[3, window]``.
        zscore: Robust standard deviations of the loss noise a spike rises above the centre; finite, ``> 0``.
        ratio: ... and the factor it rises above the centre; finite, ``> 1``.
        floor: A spike must also reach this share of the run's early loss level; in ``[0, 1)``.
        detector: A spike test to use instead of one built from ``window`` ... ``floor`` (then those stay at their
            defaults): a :class:`~lightning_hookdiag._sentinel.SpikeDetector` or a subclass, whose ``observe(loss,
            step)`` says whether the step trips. Each callback uses its own copy, so that two callbacks given one
            configuration keep separate baselines.

    Raises:
        ValueError: For an invalid field; the message names ``SentinelConfig.<field>``, the value and what is valid.

    Example:
        >>> SentinelConfig(mode="loss+grads", warmup=5).build_detector().warmup
        5
        >>> SentinelConfig(warmup=60)
        Traceback (most recent call last):
        ...
        ValueError: SentinelConfig.warmup: expected an integer in [3, window=50], got 60
    """

    mode: Literal["loss", "loss+grads"] | None = "loss"
    window: int = 50
    warmup: int = 20
    zscore: float = 8.0
    ratio: float = 10.0
    floor: float = 1e-2
    detector: SpikeDetector | None = None

    def __post_init__(self) -> None:
        name = f"{type(self).__name__}."
        object.__setattr__(self, "mode", choice(name + "mode", self.mode, [*SENTINEL_MODES, None]))
        window = integer(name + "window", self.window, "an integer >= 3", lambda v: v >= 3)
        resolved: dict[str, Any] = {
            "window": window,
            "warmup": integer(
                name + "warmup", self.warmup, f"an integer in [3, window={window}]", lambda v: 3 <= v <= window
            ),
            "zscore": number(name + "zscore", self.zscore, "a finite number > 0", lambda v: 0.0 < v < math.inf),
            "ratio": number(name + "ratio", self.ratio, "a finite number > 1", lambda v: 1.0 < v < math.inf),
            "floor": number(name + "floor", self.floor, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0),
        }
        for key, value in resolved.items():
            object.__setattr__(self, key, value)
        self._check_detector()

    def _check_detector(self) -> None:
        """A detector object replaces the built one: settings for the built one beside it would go unused."""
        if self.detector is None:
            return
        if not isinstance(self.detector, SpikeDetector):
            raise ValueError(
                f"SentinelConfig.detector: expected None or a SpikeDetector (or a subclass), got {self.detector!r}"
            )
        defaults = SentinelConfig()
        changed = [f.name for f in fields(self)[1:-1] if getattr(self, f.name) != getattr(defaults, f.name)]
        if changed:
            raise ValueError(
                f"SentinelConfig: {', '.join(changed)} configure the built spike test, but detector= replaces it;"
                " give them to the detector instead"
            )

    def build_detector(self) -> SpikeDetector:
        """A fresh spike test: a copy of :attr:`detector`, or one built from the settings."""
        if self.detector is not None:
            return copy.deepcopy(self.detector)
        return SpikeDetector(self.window, self.warmup, self.zscore, self.ratio, floor=self.floor)


@dataclass(frozen=True)
class OutputConfig:
    """What the callback writes besides each sampled step's values: the summary table, charts and heatmaps.

    Args:
        summary: At the end of fit, print (rank zero) a table of the last sampled step's values per layer in depth
            order, with the rules that fired marked.
        charts: ``"default"``: the summary group and every per-layer chart, except that the per-layer non-finite
            counts (``act_nonfinite``, ``act_grad_nonfinite``: 0 in a healthy run) are logged only on the steps where
            a layer's is not 0 (their ``_max`` summary is logged on every sampled step). ``"all"``: every per-layer
            value on every sampled step as well.
        heatmap_stats: Statistics drawn as a layers-by-sampled-steps heatmap image into every logger that stores
            images (``<prefix>_heatmap/<stat>``; log colour scale, zero black, missing grey, NaN/Inf red), at the end
            of the fit and every ``heatmap_every_n_steps``. The default shows a vanishing or blocked gradient
            (``act_grad_norm``) and a dead block (``act_std`` of 0). Statistics not in the callback's ``stats`` are
            left out.
        heatmap_every_n_steps: Also draw the heatmaps on sampled steps divisible by this (a multiple of the callback's
            ``every_n_steps``); ``None``: only at the end of the fit.

    Raises:
        ValueError: For an invalid field; the message names ``OutputConfig.<field>``, the value and what is valid.

    Example:
        >>> OutputConfig(summary=False, heatmap_stats=["act_std"]).heatmap_stats
        ('act_std',)
        >>> OutputConfig(charts="some")
        Traceback (most recent call last):
        ...
        ValueError: OutputConfig.charts: expected one of ['default', 'all'], got 'some'
    """

    summary: bool = True
    charts: Literal["default", "all"] = "default"
    heatmap_stats: Sequence[str] = ("act_grad_norm", "act_std")
    heatmap_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        name = f"{type(self).__name__}."
        resolved: dict[str, Any] = {
            "summary": boolean(name + "summary", self.summary),
            "charts": choice(name + "charts", self.charts, CHARTS),
            "heatmap_stats": tuple(
                names(name + "heatmap_stats", self.heatmap_stats, ALL_STATS + OPT_IN_STATS, "statistic")
            ),
            "heatmap_every_n_steps": integer(
                name + "heatmap_every_n_steps",
                self.heatmap_every_n_steps,
                "None or an integer >= 1",
                lambda v: v >= 1,
                optional=True,
            ),
        }
        for key, value in resolved.items():
            object.__setattr__(self, key, value)


Config = TypeVar("Config", MeasureConfig, SentinelConfig, OutputConfig)


def coerce(kind: type[Config], value: Config | Mapping[str, Any] | None, argument: str) -> Config:
    """``value`` as a ``kind``: the object itself, one built from a mapping of its fields, or the defaults for ``None``.

    Raises:
        ValueError: For a mapping with an unknown key (naming the valid keys) or a value of another type.

    Example:
        >>> coerce(OutputConfig, {"summary": False}, "output").summary
        False
        >>> coerce(OutputConfig, {"sumary": False}, "output")
        Traceback (most recent call last):
        ...
        ValueError: output: unknown OutputConfig field(s) ['sumary']; valid keys: ['charts', 'heatmap_every_n_steps', 'heatmap_stats', 'summary']
    """  # noqa: E501
    if isinstance(value, kind):
        return value
    if value is None:
        return kind()
    if not isinstance(value, Mapping):
        raise ValueError(f"{argument}: expected a {kind.__name__}, a mapping of its fields or None, got {value!r}")
    valid = sorted(f.name for f in fields(kind))
    unknown = sorted(str(key) for key in value if key not in valid)
    if unknown:
        raise ValueError(f"{argument}: unknown {kind.__name__} field(s) {unknown}; valid keys: {valid}")
    return kind(**value)


# ------------------------------------------------------------------------------------------- the earlier spellings
GROUPS: dict[str, type[MeasureConfig] | type[OutputConfig]] = {"measure": MeasureConfig, "output": OutputConfig}
OLD_KEYWORDS = {f.name: group for group, kind in GROUPS.items() for f in fields(kind)}
"""The callback's keywords of earlier releases, each the field of the same name of a group (the argument)."""


def regroup(old: Mapping[str, Any], groups: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Move the deprecated keywords ``old`` into the callback's ``groups`` (argument name to value).

    Returns the groups and one deprecation message per keyword (the callback warns with them: this module stays
    free of Lightning).

    A keyword joins its group's mapping (``None``: an empty one); a keyword whose field the group also sets, or any
    beside a configuration object, is an error: which of the two values was meant is not known.

    Raises:
        TypeError: For a keyword the callback never had (as Python says it for any function).
        ValueError: For a setting given both ways.
    """
    unknown = sorted(set(old) - set(OLD_KEYWORDS))
    if unknown:
        raise TypeError(
            f"LayerHealthCallback() got unexpected keyword argument(s) {unknown}; valid: every_n_steps, layers, stats,"
            f" prefix, on_anomaly, {', '.join(GROUPS)}, sentinel, rules (and, deprecated, {sorted(OLD_KEYWORDS)})"
        )
    merged, messages = dict(groups), []
    for name, value in old.items():
        group = OLD_KEYWORDS[name]
        kind = GROUPS[group].__name__
        messages.append(
            f"LayerHealthCallback({name}=...) is deprecated and will be removed in the next release; use"
            f" LayerHealthCallback({group}={{'{name}': ...}}) or {group}={kind}({name}=...)"
        )
        given = merged[group] if merged[group] is not None else {}
        if not isinstance(given, Mapping):
            raise ValueError(
                f"LayerHealthCallback: {name}= (deprecated) given beside {group}={given!r}; set {kind}.{name} there"
            )
        if name in given:
            raise ValueError(
                f"LayerHealthCallback: {name}={value!r} (deprecated) and {group}={{'{name}': {given[name]!r}}} both set"
                f" {kind}.{name}; keep only {group}="
            )
        merged[group] = {**given, name: value}
    return merged, messages


def sentinel_config(value: SentinelConfig | Mapping[str, Any] | str | None, moved: Mapping[str, Any]) -> SentinelConfig:
    """The callback's ``sentinel=`` as a :class:`SentinelConfig`, with the settings ``moved`` from ``RuleConfig``.

    ``None``, ``"loss"`` and ``"loss+grads"`` are the mode, as in earlier releases.

    Raises:
        ValueError: For an invalid value, or a setting given both in ``rules=`` (deprecated) and in ``sentinel=``.
    """
    if value is None or isinstance(value, str):
        value = {"mode": choice("sentinel", value, [*SENTINEL_MODES, None])}
    if not isinstance(value, (SentinelConfig, Mapping)):
        raise ValueError(
            f"sentinel: expected one of {[*SENTINEL_MODES, None]}, a SentinelConfig or a mapping of its fields,"
            f" got {value!r}"
        )
    if isinstance(value, SentinelConfig) and moved:
        raise ValueError(
            f"LayerHealthCallback: rules= sets the sentinel's {sorted(moved)} (deprecated) beside sentinel={value!r};"
            " set them in the SentinelConfig"
        )
    if isinstance(value, Mapping):
        both = sorted(set(value) & set(moved))
        if both:
            raise ValueError(
                f"LayerHealthCallback: rules= (deprecated spike_* names) and sentinel= both set SentinelConfig {both};"
                " keep only sentinel="
            )
        value = {**value, **moved}
    return coerce(SentinelConfig, value, "sentinel")


def delegate(group: str, name: str) -> Any:
    """A read-only property reading field ``name`` of the attribute ``group``: a flat name of an earlier release."""

    def read(self: Any) -> Any:
        return getattr(getattr(self, group), name)

    return property(read, doc=f"``{group}.{name}`` (read-only; set it in the group).")
