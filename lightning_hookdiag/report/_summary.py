"""The text summary of a run: one statistic per layer in depth order, plus one line per statistic family."""

from __future__ import annotations

import math

from lightning_hookdiag._table import display_name, format_value, plural, table_lines
from lightning_hookdiag.report._health_log import HealthLog

__all__ = ["format_summary"]

_NONFINITE_COUNTERS = ("act_nonfinite", "act_grad_nonfinite")
_MAX_NAMED = 5


def _finite(series: dict[int, float]) -> list[float]:
    return [v for v in series.values() if math.isfinite(v)]


def _layer_rows(log: HealthLog, stat: str, last_step: int) -> list[list[str]]:
    rows = []
    for name in log.layers(stat):
        series = log.stats[stat][name]
        latest_step = max(series)
        latest = format_value(series[latest_step])
        if latest_step != last_step:  # a layer that stopped running: its latest value is stale
            latest += f" @{latest_step}"
        finite = _finite(series)
        bad = len(series) - len(finite)
        depth = log.depth_of(name, stat)
        spread = [format_value(min(finite)), format_value(max(finite))] if finite else ["-", "-"]
        note = f"{bad} non-finite" if bad else ""
        rows.append(["-" if depth is None else str(depth), display_name(name), latest, *spread, note])
    return rows


def _count_line(log: HealthLog, stat: str) -> str:
    hits = []
    for name in log.layers(stat):
        if bad_steps := [step for step, v in sorted(log.stats[stat][name].items()) if v != 0]:  # NaN is no all-clear
            hits.append(f"{display_name(name)} (from step {bad_steps[0]})")
    if not hits:
        return f"{stat}: none"
    more = f", and {len(hits) - _MAX_NAMED} more" if len(hits) > _MAX_NAMED else ""
    return f"{stat}: NaN/Inf in {', '.join(hits[:_MAX_NAMED])}{more}"


def _total_line(log: HealthLog, stat: str) -> str:
    series = log.totals[stat]
    last = max(series)
    finite = _finite(series)
    spread = f", min {format_value(min(finite))}, max {format_value(max(finite))}" if finite else ""
    return f"{stat}: latest {format_value(series[last])} (step {last}){spread}"


def format_summary(log: HealthLog, stat: str) -> str:
    """A plain-text table of ``stat``, a per-layer statistic of ``log``: depth, latest value, min and max over steps.

    Family lines follow: per-step totals such as ``grad_norm_total``, the layers whose non-finite counters ever
    fired, and which statistics the logs hold.

    Args:
        log: The run's health statistics (:func:`~lightning_hookdiag.report.read_health_log`).
        stat: The per-layer statistic to tabulate, e.g. ``"act_std"``.

    Raises:
        KeyError: If ``stat`` is not in ``log.stats``.

    Example:
        >>> from lightning_hookdiag.report._health_log import Scalar, build_health_log
        >>> log = build_health_log([
        ...     Scalar("layer_health/depth/fc2", 0, 1.0), Scalar("layer_health/depth/fc1", 0, 0.0),
        ...     Scalar("layer_health/act_std/fc1", 0, 1.0), Scalar("layer_health/act_std/fc1", 2, 0.5),
        ...     Scalar("layer_health/act_std/fc2", 0, 3.0), Scalar("layer_health/act_std/fc2", 2, 4.0),
        ... ])
        >>> print(format_summary(log, "act_std"))
        layer_health/act_std: 2 layers, 2 sampled steps (0..2)
          depth  layer  latest  min  max
              0  fc1       0.5  0.5    1
              1  fc2         4    3    4
        stats present: act_std (2)
    """
    steps = log.stat_steps(stat)
    unit = "parameters" if log.is_parameter_stat(stat) else "layers"
    sampled = f"{plural(len(steps), 'sampled step')} ({steps[0]}..{steps[-1]})"
    lines = [f"{log.prefix}/{stat}: {len(log.stats[stat])} {unit}, {sampled}"]
    header = ["depth", unit[:-1], "latest", "min", "max", ""]
    lines += table_lines(header, _layer_rows(log, stat, steps[-1]), [">", "<", ">", ">", ">", "<"])
    lines += [_total_line(log, s) for s in log.total_names]
    lines += [_count_line(log, s) for s in _NONFINITE_COUNTERS if s in log.stats]
    present = ", ".join(f"{s} ({len(log.stats[s])})" for s in log.stat_names)
    lines.append(f"stats present: {present}" + "".join(f", {s}" for s in log.total_names))
    return "\n".join(lines)
