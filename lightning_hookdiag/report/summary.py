"""The text summary of a run: one statistic per layer in depth order, plus one line per statistic family."""

from __future__ import annotations

import math

from lightning_hookdiag.report.health_log import HealthLog

__all__ = ["format_bytes", "format_step_table", "format_summary", "format_value"]

_COUNT_STATS = ("act_nonfinite", "act_grad_nonfinite")
_MAX_NAMED = 5


def format_value(value: float) -> str:
    """A statistic in four significant digits; non-finite values as ``nan``/``inf``/``-inf``.

    Example:
        >>> format_value(0.000123456), format_value(float("nan")), format_value(1234567.0)
        ('0.0001235', 'nan', '1.235e+06')
    """
    return f"{value:.4g}"


def format_bytes(value: float) -> str:
    """A byte count in binary units, as memory tools print it.

    Example:
        >>> format_bytes(512.0), format_bytes(33792.0), format_bytes(3 * 2**30)
        ('512 B', '33.0 KiB', '3.0 GiB')
    """
    if not math.isfinite(value):
        return format_value(value)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} GiB"


def _display(name: str) -> str:
    # The root module logs under an empty name, which would otherwise be an invisible row.
    return name or "(root)"


def _layer_rows(log: HealthLog, stat: str, last_step: int) -> list[list[str]]:
    rows = []
    for name in log.layers(stat):
        series = log.stats[stat][name]
        latest_step = max(series)
        latest = format_value(series[latest_step])
        if latest_step != last_step:  # a layer that stopped running: its latest value is stale
            latest += f" @{latest_step}"
        finite = [v for v in series.values() if math.isfinite(v)]
        bad = len(series) - len(finite)
        depth = log.depth_of(name, stat)
        rows.append(
            [
                "-" if depth is None else str(depth),
                _display(name),
                latest,
                format_value(min(finite)) if finite else "-",
                format_value(max(finite)) if finite else "-",
                f"{bad} non-finite" if bad else "",
            ]
        )
    return rows


def _table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    # Depth and numbers read best right-aligned, names and notes left-aligned.
    align = align or [">", "<", ">", ">", ">", "<"]
    return [
        "  " + "  ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]


def _count_line(log: HealthLog, stat: str) -> str:
    hits = []
    for name in log.layers(stat):
        bad_steps = [
            step for step, v in sorted(log.stats[stat][name].items()) if v != 0
        ]  # a NaN counter is no all-clear
        if bad_steps:
            hits.append(f"{_display(name)} (from step {bad_steps[0]})")
    if not hits:
        return f"{stat}: none"
    more = f", and {len(hits) - _MAX_NAMED} more" if len(hits) > _MAX_NAMED else ""
    return f"{stat}: NaN/Inf in {', '.join(hits[:_MAX_NAMED])}{more}"


def _total_line(log: HealthLog, stat: str) -> str:
    series = log.totals[stat]
    last = max(series)
    finite = [v for v in series.values() if math.isfinite(v)]
    spread = f", min {format_value(min(finite))}, max {format_value(max(finite))}" if finite else ""
    return f"{stat}: latest {format_value(series[last])} (step {last}){spread}"


def format_summary(log: HealthLog, stat: str) -> str:
    """A plain-text table of ``stat`` per layer (depth, latest value, min and max over steps), then family lines.

    Family lines give per-step totals such as ``grad_norm_total``, the layers whose non-finite counters ever
    fired, and which statistics the logs hold.

    Args:
        log: The run's statistics.
        stat: A per-layer statistic present in ``log.stats``.

    Raises:
        KeyError: If ``stat`` is not in ``log.stats``.

    Example:
        >>> from lightning_hookdiag.report.health_log import Scalar, build_health_log
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
    sampled = f"{len(steps)} sampled step{'s' if len(steps) > 1 else ''} ({steps[0]}..{steps[-1]})"
    lines = [f"{log.prefix}/{stat}: {len(log.stats[stat])} {unit}, {sampled}"]
    lines += _table(["depth", unit[:-1], "latest", "min", "max", ""], _layer_rows(log, stat, steps[-1]))
    lines += [_total_line(log, s) for s in log.total_names]
    lines += [_count_line(log, s) for s in _COUNT_STATS if s in log.stats]
    present = ", ".join(f"{s} ({len(log.stats[s])})" for s in log.stat_names)
    lines.append(f"stats present: {present}" + "".join(f", {s}" for s in log.total_names))
    return "\n".join(lines)


_TABLE_STATS = ("act_mean", "act_std", "act_dead_frac", "act_grad_norm", "act_saved_bytes")
_FORMATS = {"act_saved_bytes": format_bytes}


def format_step_table(
    values: dict[str, dict[str, float]], order: list[str], marks: dict[str, list[str]], title: str
) -> str:
    """A compact table of one step's values per layer, in depth order, with the rules that fired marked.

    Args:
        values: Statistic name to ``{layer: value}`` (as logged on one step).
        order: Layers in depth order; layers of ``values`` missing from it follow in name order.
        marks: Layer to the names of the rules that fired on it.
        title: First line.

    Example:
        >>> values = {"act_std": {"fc1": 1.0, "relu": 0.5}, "act_dead_frac": {"relu": 0.95}}
        >>> print(format_step_table(values, ["fc1", "relu"], {"relu": ["dead_units"]}, "step 9"))
        step 9
          depth  layer  act_std  act_dead_frac  findings
              0  fc1          1              -
              1  relu       0.5           0.95  dead_units
    """
    stats = [s for s in _TABLE_STATS if s in values]
    layers = {name for s in stats for name in values[s]}
    ordered = [n for n in order if n in layers] + sorted(layers - set(order))
    rows = [
        [str(i), _display(name)]
        + [(_FORMATS.get(s, format_value))(values[s][name]) if name in values[s] else "-" for s in stats]
        + [", ".join(marks.get(name, []))]
        for i, name in enumerate(ordered)
    ]
    header = ["depth", "layer", *stats, "findings"]
    return "\n".join([title, *_table(header, rows, [">", "<", *(">" for _ in stats), "<"])])
