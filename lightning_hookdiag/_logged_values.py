"""One sampled step's host values as logged keys and as the rules' values, and the notes on what it could not measure.

Pure Python on plain floats (no torch): the host copy of the pooled state is ``{name: [float, ...]}``, one value per
layer or parameter. Keys: :mod:`lightning_hookdiag._keys` (``docs/statistics.md#keys``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from lightning_hookdiag._keys import depth_of, name_key, step_key, tag, tag_width
from lightning_hookdiag._vocabulary import PER_PARAMETER_STATS, PRECURSOR_STATS, SUMMARIES, counted_by_gradient

if TYPE_CHECKING:
    from lightning_hookdiag._step_state import Trip

__all__ = [
    "Histograms",
    "KeyCache",
    "Note",
    "ObservedStep",
    "StepFacts",
    "histogram_note",
    "histogram_series",
    "late_note",
    "no_logger_note",
    "opt_in_note",
    "parameter_facts",
    "step_notes",
    "step_values",
    "undefined_note",
]


class Note(NamedTuple):
    """A one-time message: given once per ``key`` (a warning, or an info line when ``info``)."""

    key: str
    message: str
    info: bool = False


class KeyCache:
    """The logged keys of the fit (:mod:`lightning_hookdiag._keys`), with the depth of every layer fixed once seen.

    A layer's depth is its place in the forward order of the first sampled step it ran on (agreed over processes);
    a layer first seen on a later step is numbered after the known ones, so a key never changes once numbered. Keys
    are formatted once per statistic and formatted again only when the names or the numbering change (1,000
    f-strings cost about 0.2 ms a step).
    """

    def __init__(self, prefix: str, n_layers: int = 1) -> None:
        self.prefix = prefix
        self.width = tag_width(n_layers)
        self.depth: dict[str, int] = {}
        self._tags: dict[tuple[str, bool], str] = {}  # the tags of numbered names, fixed for the fit
        self._keys: dict[tuple[str, bool], tuple[list[str], int, list[str]]] = {}

    def number(self, forward_order: Sequence[str]) -> None:
        """Give each layer of ``forward_order`` not numbered yet the next depth, in that order."""
        for name in forward_order:
            if name not in self.depth:
                self.depth[name] = len(self.depth)

    def tag(self, name: str, parameter: bool = False) -> str:
        """The depth part of ``name``'s keys (``x`` per digit while it has none)."""
        held = self._tags.get((name, parameter))
        if held is not None:
            return held
        depth = depth_of(name, self.depth, parameter)
        found = tag(depth, self.width)
        if depth is not None:
            self._tags[(name, parameter)] = found
        return found

    def keys(self, stat: str, names: Sequence[str], parameter: bool = False) -> list[str]:
        """The key of ``stat`` for every name, formatted again only when the names or the numbering change.

        The names are compared with the ones the keys were formatted from, not counted: a renamed parameter keeps
        their number. Copying and comparing 1,000 names costs about 2 us a statistic, formatting them about 30.
        """
        names = list(names)
        numbered = len(self.depth)
        cached = self._keys.get((stat, parameter))
        if cached is None or cached[0] != names or cached[1] != numbered:
            formatted = [name_key(self.prefix, stat, self.tag(name, parameter), name) for name in names]
            cached = self._keys[(stat, parameter)] = (names, numbered, formatted)
        return cached[2]

    def key(self, stat: str, name: str | None = None, parameter: bool = False) -> str:
        """One key; without ``name``, the key of a value with one number per step (the summary group)."""
        if name is None:
            return step_key(self.prefix, stat)
        return name_key(self.prefix, stat, self.tag(name, parameter), name)


class StepFacts(NamedTuple):
    """What one sampled step could not observe, by layer index (from the recorder and the aggregator)."""

    unit_mismatch: frozenset[int] = frozenset()  # units changed between calls or processes: no act_dead_frac
    no_float: frozenset[int] = frozenset()  # the output held no floating-point tensor
    sparse: frozenset[int] = frozenset()  # the output (or its gradient) was a sparse tensor
    empty: frozenset[int] = frozenset()  # a call's output had no elements
    nested: frozenset[int] = frozenset()  # the output (or its gradient) was a nested tensor (strided or jagged)
    opaque: frozenset[tuple[int, str]] = frozenset()  # (layer, what): a meta tensor or a wrapper subclass (DTensor)


@dataclass(frozen=True)
class ObservedStep:
    """One finished window, read back to the host: what the callback logs and the rules read.

    ``facts`` is the step's one mapping of facts by name (:attr:`~lightning_hookdiag.rules.Observed.facts`): the
    engine's (``missing_grads``, ``param_facts``, the rules' per-name numbers) and every component's.
    """

    step: int
    layers: bool  # False: a window of parameters only
    trip: Trip | None
    host: dict[str, list[float]]  # the pooled values by name, one list per statistic (step_values)
    wanted: list[str]  # the statistics to log, in order
    unobserved: StepFacts  # what the step could not observe
    forward_order: list[str]
    backward_order: list[str]
    facts: dict[str, Any] = field(default_factory=dict)
    histogram_edges: list[float] | None = None  # the inner bin edges, when the step logs histograms


def step_values(
    observed: ObservedStep,
    *,
    keys: KeyCache,
    layer_names: Sequence[str],
    param_names: Sequence[str],
    undefined_skipped: Collection[str] = (),
    total: bool = True,
    zero_quiet: Collection[str] = (),
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The step's logged metrics, and the same values by statistic and name with what only the rules read.

    A layer's statistic exists where the layer ran (``count``; a gradient statistic where a gradient arrived,
    ``grad_count``), a parameter's where it was measured (``param_seen``). The layers of ``observed.forward_order``
    not numbered yet are numbered first (:meth:`KeyCache.number`). Besides the per-name values, the step logs its
    summary group: ``grad_norm_total`` and the worst value of each statistic of
    :data:`~lightning_hookdiag._vocabulary.SUMMARIES` (NaN if one of its values is NaN).

    Args:
        observed: Its ``host`` holds every name of ``wanted``, ``count``, ``grad_count``, ``param_seen`` and
            ``grad_norm_total`` (and ``param_norm`` when ``param_update_ratio`` is wanted), and the precursors its
            fact ``precursors`` names (a NaN value: not seen; an owner ``""``: no module).
        keys: Formats the keys.
        layer_names: The observed modules, in the order of the per-layer rows.
        param_names: The tracked parameters, in the order of the per-parameter rows.
        undefined_skipped: Statistics whose NaN means "undefined here" and is not logged (``act_dead_frac`` of a
            layer that is not ReLU-like; an opt-in statistic of an all-zero or constant output).
            ``param_update_ratio`` of weights that were all 0 before the step is never logged (a ratio to 0 is
            undefined: :func:`undefined_note`); the rules still get it.
        total: Log ``grad_norm_total`` (when a parameter was measured).
        zero_quiet: Statistics whose per-name values are logged only when one of them is not 0 (their summary is
            logged on every step).
    """
    host = observed.host
    count, grad_count, seen = host["count"], host["grad_count"], host["param_seen"]
    keys.number(observed.forward_order)
    metrics: dict[str, float] = {}
    values: dict[str, dict[str, float]] = {}
    for stat in observed.wanted:
        parameter = stat in PER_PARAMETER_STATS
        if parameter:
            names, present = param_names, [s > 0 for s in seen]
        else:
            ran = grad_count if counted_by_gradient(stat) else count
            names, present = layer_names, [c > 0 for c in ran]
        logged = _logged(stat, host, present)
        skip_nan = stat in undefined_skipped
        group: dict[str, float] = {}
        shown: dict[str, float] = {}  # the logged ones: not undefined
        for key, name, value, ok, log in zip(
            keys.keys(stat, names, parameter), names, host[stat], present, logged, strict=True
        ):
            if ok and not (skip_nan and value != value):
                group[name] = value
                if log:
                    shown[key] = value
        if group:
            values[stat] = group
        metrics.update(_summaries(keys, stat, shown.values()))
        if stat not in zero_quiet or any(v != 0 for v in shown.values()):
            metrics.update(shown)
    precursors: Mapping[str, list[str]] = observed.facts.get("precursors", {})
    for stat, owners in precursors.items():
        group = {n: v for n, v in zip(owners, host[stat], strict=True) if n and v == v}  # NaN: not observed
        if group:
            values[stat] = group
            if stat in PRECURSOR_STATS:
                metrics.update({keys.key(stat, n): v for n, v in group.items()})
    if total and any(s > 0 for s in seen):
        metrics[keys.key("grad_norm_total")] = host["grad_norm_total"][0]
    return metrics, values


def parameter_facts(host: Mapping[str, list[float]], param_names: Sequence[str]) -> dict[str, dict[str, float]]:
    """The per-parameter numbers the rules read but the step does not log, from the host values where present.

    ``param_stale_grad_norm`` (from ``stale_grad_sq``: 0 on every healthy step, so only the others) and
    ``param_norm_min`` (the smallest ``param_norm`` over processes, of the parameters measured), which
    ``replica_divergence`` compares ``param_norm`` with.
    """
    facts: dict[str, dict[str, float]] = {}
    if "stale_grad_sq" in host:
        held = zip(param_names, host["stale_grad_sq"], strict=True)
        facts["param_stale_grad_norm"] = {name: math.sqrt(sq) for name, sq in held if sq != 0}
    if "param_norm_min" in host:
        present_min = zip(param_names, host["param_norm_min"], host["param_seen"], strict=True)
        facts["param_norm_min"] = {name: low for name, low, s in present_min if s > 0}
    return facts


def _logged(stat: str, host: Mapping[str, list[float]], present: Sequence[bool]) -> list[bool]:
    """Which of ``stat``'s values are defined: all, but ``param_update_ratio`` of weights that were all 0."""
    if stat != "param_update_ratio" or "param_norm" not in host:
        return [True] * len(present)
    # A weight norm of exactly 0 (a zero-initialised bias): ||dw|| / 0 is 0/0 or x/0, undefined. A NaN or Inf
    # weight norm is no zero: its ratio is logged as it is.
    return [norm != 0 for norm in host["param_norm"]]


def _summaries(keys: KeyCache, stat: str, logged: Collection[float]) -> dict[str, float]:
    """The summary group's values of ``stat``: its worst logged value per :data:`SUMMARIES` entry."""
    if not logged or stat not in SUMMARIES:
        return {}
    if any(v != v for v in logged):  # a NaN is the worst there is, and min/max would skip or keep it by position
        return {keys.key(f"{stat}_{kind}"): math.nan for kind in SUMMARIES[stat]}
    return {keys.key(f"{stat}_{kind}"): (min if kind == "min" else max)(logged) for kind in SUMMARIES[stat]}


def undefined_note(observed: ObservedStep, param_names: Sequence[str]) -> Note | None:
    """The note on the ``param_update_ratio`` values left out because the weights were all 0, or ``None``."""
    host = observed.host
    if "param_update_ratio" not in observed.wanted or "param_norm" not in host:
        return None
    held = zip(param_names, host["param_norm"], host["param_seen"], strict=True)
    zero = [name for name, norm, seen in held if seen > 0 and norm == 0]
    if not zero:
        return None
    shown = ", ".join(zero[:3]) + (f" and {len(zero) - 3} more" if len(zero) > 3 else "")
    text = (
        f"param_update_ratio is not logged for parameters whose weights were all 0 before the step ({shown} at step"
        f" {observed.step}; zero-initialised biases, say): ||dw|| / ||w|| with ||w|| = 0 is undefined, so it is left"
        " out rather than logged as NaN or Inf. It is logged from the first step their weights are not all 0"
    )
    return _note("undefined:param_update_ratio", text, info=True)


class Histograms(NamedTuple):
    """One step's histograms as loggers take them: the ``left`` and ``right`` edges of every bin, and the counts."""

    left: list[float]
    right: list[float]
    series: list[tuple[str, list[float]]]  # (key, counts) per layer and kind (output, then gradient) where counted


def histogram_series(
    act: Sequence[float], grad: Sequence[float], inner: Sequence[float], *, keys: KeyCache, layer_names: Sequence[str]
) -> Histograms:
    """The step's ``act_hist`` and ``act_grad_hist``: ``act`` and ``grad`` hold ``len(inner) + 1`` counts per layer.

    The outer bins are open-ended; they get a finite edge a decade out for loggers that need one.

    Args:
        act: The outputs' counts, layer after layer.
        grad: The output gradients' counts, layer after layer.
        inner: The inner bin edges.
        keys: The fit's keys, for each layer's histogram key.
        layer_names: The layers, in the order of the counts.
    """
    bins = len(inner) + 1
    series = []
    for kind, counts in (("act_hist", act), ("act_grad_hist", grad)):
        for i, name in enumerate(layer_names):
            row = list(counts[i * bins : (i + 1) * bins])
            if sum(row) > 0:
                series.append((keys.key(kind, name), row))
    return Histograms([inner[0] * 10, *inner], [*inner, inner[-1] * 10], series)


_LAYER_NOTES = {
    "unit_mismatch": "the number of units of {name!r} changed between calls or differs between processes (a module"
    " shared by inputs of different widths); act_dead_frac is not tracked for it",
    "no_float": "the output of {name!r} holds no floating-point tensor (an integer, bool, complex or quantized tensor"
    " has no real floating-point values to reduce); it is not observed",
    "sparse": "the output of {name!r} (or its gradient) is a sparse tensor; sparse tensors are not observed",
    "nested": "the output of {name!r} (or its gradient) is a nested tensor (strided or jagged layout); nested tensors"
    " are not reduced, so {name!r} is skipped on the steps it returns one",
    "opaque": "the output of {name!r} (or its gradient) is {what}; its values cannot be reduced, so it is not observed",
    "empty": "selected module {name!r} ran during sampled step {step} but its output had no elements; no statistics"
    " for it",
    "not_run": "selected module {name!r} did not run during sampled step {step} (its forward was called directly"
    " instead of the module, or a branch was not taken); no statistics for it",
    "no_grad": "the output of {name!r} required grad but received no gradient on a sampled step (a detached branch,"
    " or an output that does not reach the loss); no act_grad statistics for it",
}


def _note(key: str, text: str, info: bool = False) -> Note:
    return Note(key, "LayerHealthCallback: " + text, info)


def _layer_note(kind: str, name: str, step: int = 0, info: bool = False, what: str = "") -> Note:
    return _note(f"{kind}:{name}", _LAYER_NOTES[kind].format(name=name, step=step, what=what), info)


_OVERFLOW_CHECKS = (
    ("count", "act_nonfinite", ("act_mean", "act_std", "act_absmax"), "output"),
    ("grad_count", "act_grad_nonfinite", ("act_grad_norm",), "output gradient"),
)


def step_notes(
    observed: ObservedStep,
    layer_names: Sequence[str],
    *,
    default_selection: bool = True,
    quiet_not_run: Collection[str] = (),
) -> list[Note]:
    """The notes about what the step could not observe, in a fixed order: layers, missing gradients, overflows.

    Args:
        observed: The step; in a window of parameters only, a layer that did not run is no news.
        layer_names: The observed modules, in the order of the per-layer rows.
        default_selection: ``layers=None``: a module inside a selected module that ran is observed through it, so
            that it did not run is an info note, not a warning.
        quiet_not_run: Modules whose not running is a note, not a warning (no parameters of their own).
    """
    step, host, facts = observed.step, observed.host, observed.unobserved
    kinds = ("unit_mismatch", "no_float", "sparse", "nested")
    unobservable = {kind: [layer_names[i] for i in sorted(getattr(facts, kind))] for kind in kinds}
    unobservable["sparse"].sort()  # by name, as the sparse notes always were; the others in layer order
    notes = [_layer_note(kind, name) for kind in kinds for name in unobservable[kind]]
    opaque = [(layer_names[i], what) for i, what in sorted(facts.opaque)]
    notes += [_layer_note("opaque", name, what=what) for name, what in opaque]
    skipped = {*unobservable["no_float"], *unobservable["sparse"], *unobservable["nested"]}
    skipped.update(name for name, _ in opaque)
    empty = {layer_names[i] for i in facts.empty}
    ran = [name for name, c in zip(layer_names, host["count"], strict=True) if c > 0]
    for name in (name for name, c in zip(layer_names, host["count"], strict=True) if c == 0):
        if name in empty:
            notes.append(_layer_note("empty", name, step))
        elif name not in skipped and observed.layers:
            # Inside a selected module that ran (MultiheadAttention's out_proj): observed through it.
            covered = default_selection and any(name.startswith(r + ".") for r in ran)
            notes.append(_layer_note("not_run", name, step, info=covered or name in quiet_not_run))
    # A note, not a warning: rule no_gradient reports the outputs that cut the network off from the gradient; the
    # others (a pooler under a token-level head) do not reach the loss by design.
    notes += [_layer_note("no_grad", name, info=True) for name in observed.facts.get("missing_grads", ())]
    # A statistic that is not finite although its tensor held only finite values overflowed what it is held in
    # (docs/statistics.md#the-numeric-contract); NaN statistics of a layer that observed nothing are no overflow.
    for count_key, nonfinite_key, stats, what in _OVERFLOW_CHECKS:
        for stat in (stat for stat in stats if {count_key, nonfinite_key, stat} <= host.keys()):
            held = zip(layer_names, host[count_key], host[nonfinite_key], host[stat], strict=True)
            for name, count, bad, value in held:
                if count > 0 and bad == 0 and not math.isfinite(value):
                    text = (
                        f"{stat} of {name!r} is {value} although its {what} held no NaN/Inf: it overflowed what it is"
                        " held in (float64 sums of squares beyond ~1e154, float32 maxima beyond ~3.4e38, float32 sums"
                        " on a device without float64); it is logged as it is, not as a finite number"
                    )
                    notes.append(_note(f"overflow:{stat}:{name}", text))
    return notes


def histogram_note(skipped: Sequence[str]) -> Note | None:
    """The note for the loggers (by class name) that cannot store histograms, or ``None``."""
    text = f"{', '.join(skipped)} cannot store histograms; they are logged only to TensorBoard and W&B loggers"
    return _note("histograms:" + ",".join(skipped), text, info=True) if skipped else None


def late_note(late: int | None, step: int, every_n_steps: int) -> Note | None:
    """The note for a sampled step ``late`` observed on the next training batch (at ``step``), or ``None``."""
    text = (
        f"optimizer step {late} (every_n_steps={every_n_steps}) fell inside a training batch that made several"
        " optimizer steps (manual optimization); hooks observe whole batches, so the next batch is observed instead"
        f" and logged at its first optimizer step, {step}. Sampled batches are logged at their first optimizer step"
    )
    return None if late is None else _note("late", text, info=True)


def no_logger_note(n_loggers: int) -> Note | None:
    """The note for a Trainer without loggers (``logger=False``, ``barebones=True``), or ``None``."""
    text = (
        "the Trainer has no logger (logger=False or barebones=True), so no statistic is logged; the last sampled"
        " step's values are kept in callback.last_metrics and the findings in callback.findings"
    )
    return None if n_loggers else _note("no_logger", text, info=True)


def opt_in_note(note: str) -> Note | None:
    """The note :attr:`~lightning_hookdiag._opt_in.OptInPlan.note` gives, or ``None`` when it gives none."""
    return _note("opt_in_note", note, info=True) if note else None
