"""Plain-text formatting of statistics, shared by the callback's end-of-fit summary and the report: no torch."""

from __future__ import annotations

import math

__all__ = ["display_name", "format_bytes", "format_step_table", "format_value", "plural", "table_lines"]


def format_value(value: float) -> str:
    """A statistic in four significant digits; non-finite values as ``nan``/``inf``/``-inf``."""
    return f"{value:.4g}"


def format_bytes(value: float) -> str:
    """A byte count in binary units, as memory tools print it."""
    if not math.isfinite(value):
        return format_value(value)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} GiB"


def plural(n: int, word: str) -> str:
    """``n word``, with the plural ``s`` unless ``n`` is 1."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def display_name(name: str) -> str:
    """A layer's name as a table prints it: the root module logs under an empty name, an invisible row otherwise."""
    return name or "(root)"


def table_lines(header: list[str], rows: list[list[str]], align: list[str]) -> list[str]:
    """Rows as indented, column-aligned lines (``align``: a format alignment per column)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  " + "  ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]


_TABLE_STATS = ("act_mean", "act_std", "act_dead_frac", "act_grad_norm", "act_saved_bytes")
_FORMATS = {"act_saved_bytes": format_bytes}


def format_step_table(
    values: dict[str, dict[str, float]], order: list[str], marks: dict[str, list[str]], title: str
) -> str:
    """A compact table of one step's ``{stat: {layer: value}}`` under ``title``, with the rules that fired marked.

    Layers follow ``order`` (depth order), those missing from it in name order; ``marks`` maps a layer to the names
    of the rules that fired on it.

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
        [str(i), display_name(name)]
        + [(_FORMATS.get(s, format_value))(values[s][name]) if name in values[s] else "-" for s in stats]
        + [", ".join(marks.get(name, []))]
        for i, name in enumerate(ordered)
    ]
    header = ["depth", "layer", *stats, "findings"]
    return "\n".join([title, *table_lines(header, rows, [">", "<", *(">" for _ in stats), "<"])])
