"""``hookdiag report --diff RUN_A RUN_B``: where two runs' health statistics first part ways.

What is compared, in which order: ``docs/report.md#where-do-two-runs-first-differ-hookdiag-report---diff``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_hookdiag._errors import ReportError
from lightning_hookdiag._names import owning_layer
from lightning_hookdiag._table import display_name, format_value, plural
from lightning_hookdiag._vocabulary import counted_by_gradient
from lightning_hookdiag.report._health_log import HealthLog, depth_order, stat_order_key
from lightning_hookdiag.report._plot import draw_heatmap, load_matplotlib

__all__ = ["Alignment", "Difference", "align", "find_differences", "format_diff", "ratio_figure"]

_MAX_LISTED = 5


def is_backward(stat: str) -> bool:
    """Whether ``stat`` is measured in the backward pass (or from gradients), not from outputs or weights."""
    return counted_by_gradient(stat) or stat in ("param_grad_norm", "param_update_ratio")


@dataclass(frozen=True)
class Difference:
    """One (step, layer, statistic) whose values differ between run A and run B."""

    step: int
    layer: str
    stat: str
    a: float
    b: float


@dataclass(frozen=True)
class Alignment:
    """What both runs logged (``names``: by statistic, in vocabulary order); ``depth``: A's, completed with B's."""

    a: HealthLog
    b: HealthLog
    steps: tuple[int, ...]
    names: dict[str, tuple[str, ...]]
    depth: dict[str, int]


def _describe(log: HealthLog, label: str) -> str:
    return f"{label} has steps {log.steps[0]}..{log.steps[-1]}" if log.steps else f"{label} has no steps"


def align(a: HealthLog, b: HealthLog) -> Alignment:
    """Align two runs by step and by layer name.

    Raises:
        ReportError: If the runs were logged under different prefixes, share no step, or share no layer name for
            any statistic; the message says what each run holds.
    """
    if a.prefix != b.prefix:
        raise ReportError(
            f"the runs use different prefixes (RUN_A: '{a.prefix}', RUN_B: '{b.prefix}'); logs of one callback"
            " configuration can be compared, or pass --prefix to read both under one"
        )
    steps = tuple(sorted(set(a.steps) & set(b.steps)))
    if not steps:
        raise ReportError(f"the runs share no step: {_describe(a, 'RUN_A')}, {_describe(b, 'RUN_B')}")
    stats = sorted(set(a.stats) & set(b.stats), key=stat_order_key)
    names = {s: n for s in stats if (n := tuple(sorted(set(a.stats[s]) & set(b.stats[s]))))}
    if not names:
        some = [", ".join(sorted({n for s in log.stats.values() for n in s})[:_MAX_LISTED]) or "none" for log in (a, b)]
        raise ReportError(
            f"the runs share no layer for any statistic (RUN_A logs e.g. {some[0]}; RUN_B logs e.g. {some[1]})"
        )
    return Alignment(a=a, b=b, steps=steps, names=names, depth={**b.depth, **a.depth})


def _differ(x: float, y: float, rtol: float, atol: float) -> bool:
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) != math.isnan(y)
    if x == y:  # also equal infinities
        return False
    if math.isinf(x) or math.isinf(y):  # a relative tolerance of an infinity would hide any difference
        return True
    return not abs(x - y) <= atol + rtol * max(abs(x), abs(y))


def find_differences(alignment: Alignment, rtol: float = 1e-4, atol: float = 0.0) -> list[Difference]:
    """Every aligned (step, layer, statistic) whose values differ, in the order a change propagates.

    Two values differ when ``|a - b| > atol + rtol * max(|a|, |b|)``; NaN equals NaN (and differs from any number),
    equal infinities are equal, and an infinity differs from everything else.
    """
    keyed = []
    for stat, names in alignment.names.items():
        backward, parameters = is_backward(stat), alignment.a.is_parameter_stat(stat)
        for name in names:
            # A parameter sits at its module's depth; forward statistics go down the depths, backward ones up them,
            # and a name of no known depth follows every known one.
            d = alignment.depth.get(owning_layer(name, alignment.depth) if parameters else name)
            where = (1, 0, name) if d is None else (0, -d if backward else d, name)
            values_a, values_b = alignment.a.stats[stat][name], alignment.b.stats[stat][name]
            for step in alignment.steps:
                if step in values_a and step in values_b and _differ(values_a[step], values_b[step], rtol, atol):
                    key = (step, backward, where, stat_order_key(stat))
                    keyed.append((key, Difference(step, name, stat, values_a[step], values_b[step])))
    return [d for _, d in sorted(keyed, key=lambda item: item[0])]


def _line(d: Difference, with_stat: bool = True) -> str:
    stat = f", {d.stat}" if with_stat else ""
    ratio = d.b / d.a if d.a != 0 else (math.nan if d.b == 0 else math.copysign(math.inf, d.b))
    return (
        f"step {d.step}, {display_name(d.layer)}{stat}: A={format_value(d.a)} B={format_value(d.b)}"
        f" (B/A={format_value(ratio)})"
    )


def format_diff(alignment: Alignment, differences: list[Difference], rtol: float, atol: float) -> str:
    """The text report: what was aligned, the first difference, then the first difference of each statistic."""
    names = alignment.names
    layers = {n for s, ns in names.items() if not alignment.a.is_parameter_stat(s) for n in ns}
    params = {n for s, ns in names.items() if alignment.a.is_parameter_stat(s) for n in ns}
    steps = alignment.steps
    parts = [f"{plural(len(steps), 'common step')} ({steps[0]}..{steps[-1]})", plural(len(layers), "common layer")]
    if params:
        parts.append(plural(len(params), "common parameter"))
    lines = [f"aligned: {', '.join(parts)}, {plural(len(names), 'common statistic')}"]
    only = [", ".join(sorted(set(log.stats) - set(names), key=stat_order_key)) for log in (alignment.a, alignment.b)]
    if any(only):
        lines.append(f"not compared: only in A: {only[0] or '-'}; only in B: {only[1] or '-'}")
    if not differences:
        lines.append(f"no difference beyond rtol={rtol:g}, atol={atol:g}")
        return "\n".join(lines)
    lines.append(f"first difference: {_line(differences[0])}")
    firsts = {d.stat: d for d in reversed(differences)}  # the last one written wins: the first of each statistic
    lines.append("first difference per statistic (forward statistics in depth order, then backward ones):")
    for stat in sorted(firsts, key=lambda s: (is_backward(s), stat_order_key(s))):
        lines.append(f"  {stat}: {_line(firsts[stat], with_stat=False)}")
    return "\n".join(lines)


def ratio_figure(alignment: Alignment, stat: str) -> Any:
    """A matplotlib ``Figure``: ``B / A`` of ``stat`` per layer (depth order) and common step, log colour scale."""
    mpl = load_matplotlib()
    np = mpl.np
    parameters = alignment.a.is_parameter_stat(stat)
    names, steps = depth_order(alignment.names[stat], alignment.depth, parameters=parameters), alignment.steps

    def values(log: HealthLog) -> Any:
        return np.array([[log.stats[stat][n].get(s, math.nan) for s in steps] for n in names], dtype=float)

    with np.errstate(divide="ignore", invalid="ignore"):
        # A 0, inf or NaN in either run, or a ratio <= 0, comes out non-finite: masked as not comparable.
        data = np.log10(values(alignment.b) / values(alignment.a))
    finite = np.isfinite(data)
    top = float(np.abs(data[finite]).max()) if finite.any() else 0.0
    top = top or 1e-3  # identical runs: a visible, non-empty range around 1
    norm = mpl.colors.Normalize(vmin=-top, vmax=top)
    fig, ax, image = draw_heatmap(data, ~finite, names, steps, cmap="RdBu_r", norm=norm, parameters=parameters)
    ax.set_xlabel("optimizer step (sampled, common to both runs)")
    fig.suptitle(f"{alignment.a.prefix}/{stat}: RUN_B / RUN_A")
    ax.set_title("white: equal; red: B larger; blue: B smaller; grey: not comparable", fontsize=8)
    fig.colorbar(image, ax=ax, label="log10(B / A)")
    return fig
