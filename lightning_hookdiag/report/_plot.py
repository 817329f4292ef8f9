"""The report's heatmaps: layers in depth order (rows, shallow at top) x sampled steps (columns)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from lightning_hookdiag._errors import MissingExtraError
from lightning_hookdiag._table import display_name
from lightning_hookdiag.report._health_log import HealthLog

__all__ = ["draw_heatmap", "heatmap_figure", "load_matplotlib"]

# Beyond these many rows/columns every label would overlap; label every k-th instead.
_MAX_ROW_LABELS = 60
_MAX_COL_LABELS = 12


def load_matplotlib() -> SimpleNamespace:
    """``np``, ``Figure``, ``colors`` and ``colormaps``, imported only when a figure is asked for."""
    try:
        # The top-level import comes first so that a blocked or missing matplotlib fails here even when its
        # submodules are already cached.
        import matplotlib
        import matplotlib.colors
        import numpy as np
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingExtraError("plotting needs matplotlib: pip install 'lightning-hookdiag[plot]'") from exc
    return SimpleNamespace(np=np, Figure=Figure, colors=matplotlib.colors, colormaps=matplotlib.colormaps)


def _norm_and_mask(mpl: SimpleNamespace, data: Any) -> tuple[Any, Any, str, str]:
    np = mpl.np
    finite = np.isfinite(data)
    positive = finite & (data > 0)
    if (finite & (data < 0)).any():
        # A signed statistic (act_mean) would lose its negative half under LogNorm; a symmetric log scale keeps
        # the sign and the orders of magnitude, with the linear band set by the smallest magnitude logged.
        magnitude = np.abs(data[finite & (data != 0)])
        top = float(magnitude.max())
        norm = mpl.colors.SymLogNorm(linthresh=float(magnitude.min()), vmin=-top, vmax=top)
        return norm, ~finite, "symmetric log scale", "grey: NaN/Inf or not logged"
    if positive.any():
        low, high = float(data[positive].min()), float(data[positive].max())
        if low == high:  # a constant statistic still needs a non-empty colour range
            low, high = low / 10**0.5, high * 10**0.5
        return mpl.colors.LogNorm(vmin=low, vmax=high), ~positive, "log scale", "grey: 0, NaN/Inf or not logged"
    return mpl.colors.Normalize(vmin=0.0, vmax=1.0), ~positive, "no positive value", "grey: 0, NaN/Inf or not logged"


def _tick_positions(count: int, most: int) -> list[int]:
    return list(range(0, count, max(1, -(-count // most))))


def draw_heatmap(
    data: Any, mask: Any, names: Sequence[str], steps: Sequence[int], *, cmap: str, norm: Any, parameters: bool
) -> tuple[Any, Any, Any]:
    """Draw a names x steps array, ``mask`` grey, on a new ``Figure`` sized to it; return the figure, axes and image.

    Args:
        data: The values, one row per name and one column per step.
        mask: Where a value is missing (drawn light grey).
        names: The rows' layer or parameter names, in forward order.
        steps: The columns' sampled steps.
        cmap: A matplotlib colormap name.
        norm: The colour normalisation (linear, log or symmetric log).
        parameters: The rows are parameters (the axis label says so), else layers.
    """
    mpl = load_matplotlib()
    width = min(16.0, max(6.0, 3.0 + 0.25 * len(steps)))
    height = min(40.0, max(3.0, 1.5 + 0.22 * len(names)))
    fig = mpl.Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(
        mpl.np.ma.masked_array(data, mask=mask),
        cmap=mpl.colormaps[cmap].with_extremes(bad="lightgrey"),
        norm=norm,
        aspect="auto",
        interpolation="nearest",
        origin="upper",
    )
    rows_at = _tick_positions(len(names), _MAX_ROW_LABELS)
    ax.set_yticks(rows_at, [display_name(names[i]) for i in rows_at], fontsize=8)
    cols_at = _tick_positions(len(steps), _MAX_COL_LABELS)
    ax.set_xticks(cols_at, [str(steps[i]) for i in cols_at])
    ax.set_ylabel(f"{'parameter' if parameters else 'layer'} (forward order, shallow at top)")
    return fig, ax, image


def heatmap_figure(log: HealthLog, stat: str) -> Any:
    """A matplotlib ``Figure`` with the heatmap of ``stat``, a per-layer statistic of ``log``, not yet saved.

    Zeros, NaN/Inf and steps at which a layer was not logged are masked (drawn grey), because a log scale has no
    place for them. A statistic with negative values uses a symmetric log scale instead.
    """
    mpl = load_matplotlib()
    names, steps, rows = log.matrix(stat)
    data = mpl.np.array(rows, dtype=float).reshape(len(names), len(steps))
    norm, mask, scale, note = _norm_and_mask(mpl, data)
    parameters = log.is_parameter_stat(stat)
    fig, ax, image = draw_heatmap(data, mask, names, steps, cmap="viridis", norm=norm, parameters=parameters)
    ax.set_xlabel("optimizer step (sampled)")
    fig.suptitle(f"{log.prefix}/{stat}")
    ax.set_title(note, fontsize=8)
    fig.colorbar(image, ax=ax, label=f"{stat} ({scale})")
    return fig
