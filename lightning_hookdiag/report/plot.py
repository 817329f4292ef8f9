"""The heatmap of one statistic: layers in depth order (rows, shallow at top) x sampled steps (columns)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lightning_hookdiag.report.errors import MissingExtraError
from lightning_hookdiag.report.health_log import HealthLog

__all__ = ["heatmap_figure", "label_heatmap_axes", "load_matplotlib", "plot_heatmap"]

_MATPLOTLIB_HINT = "plotting needs matplotlib: pip install 'lightning-hookdiag[plot]'"
_MISSING_COLOUR = "lightgrey"
# Beyond these many rows/columns every label would overlap; label every k-th instead.
_MAX_ROW_LABELS = 60
_MAX_COL_LABELS = 12


def load_matplotlib() -> SimpleNamespace:
    """Import the matplotlib (and numpy) pieces the report's figures are drawn with, only when a figure is asked for.

    The report imports matplotlib nowhere else, so a summary works on a machine without the ``plot`` extra.

    Returns:
        A namespace with ``np``, ``Figure``, ``LogNorm``, ``SymLogNorm``, ``Normalize`` and ``colormaps``.

    Raises:
        MissingExtraError: If matplotlib (or numpy) cannot be imported; the message names the extra to install.

    Example:
        >>> mpl = load_matplotlib()
        >>> type(mpl.Figure()).__name__, mpl.np.__name__
        ('Figure', 'numpy')
    """
    try:
        # The top-level import comes first so that a blocked or missing matplotlib fails here even when its
        # submodules are already cached.
        import matplotlib
        import numpy as np
        from matplotlib.colors import LogNorm, Normalize, SymLogNorm
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingExtraError(_MATPLOTLIB_HINT) from exc
    return SimpleNamespace(
        np=np,
        Figure=Figure,
        LogNorm=LogNorm,
        SymLogNorm=SymLogNorm,
        Normalize=Normalize,
        colormaps=matplotlib.colormaps,
    )


def _norm_and_mask(mpl: SimpleNamespace, data: Any) -> tuple[Any, Any, str, str]:
    np = mpl.np
    finite = np.isfinite(data)
    positive = finite & (data > 0)
    if (finite & (data < 0)).any():
        # A signed statistic (act_mean) would lose its negative half under LogNorm; a symmetric log scale keeps
        # the sign and the orders of magnitude, with the linear band set by the smallest magnitude logged.
        magnitude = np.abs(data[finite & (data != 0)])
        top = float(magnitude.max())
        norm = mpl.SymLogNorm(linthresh=float(magnitude.min()), vmin=-top, vmax=top)
        return norm, ~finite, "symmetric log scale", "grey: NaN/Inf or not logged"
    if positive.any():
        low, high = float(data[positive].min()), float(data[positive].max())
        if low == high:  # a constant statistic still needs a non-empty colour range
            low, high = low / 10**0.5, high * 10**0.5
        return mpl.LogNorm(vmin=low, vmax=high), ~positive, "log scale", "grey: 0, NaN/Inf or not logged"
    return mpl.Normalize(vmin=0.0, vmax=1.0), ~positive, "no positive value", "grey: 0, NaN/Inf or not logged"


def _tick_positions(count: int, most: int) -> range:
    return range(0, count, max(1, -(-count // most)))


def label_heatmap_axes(ax: Any, names: Sequence[str], steps: Sequence[int]) -> None:
    """Label a layers x steps heatmap's rows with the layer names and its columns with the steps.

    With more than 60 rows or 12 columns only every k-th is labelled, so that the labels do not overlap. The root
    module, whose name is empty, is labelled ``(root)``.

    Args:
        ax: The matplotlib ``Axes`` the heatmap was drawn on.
        names: The row names, top to bottom.
        steps: The column steps, left to right.

    Example:
        >>> ax = load_matplotlib().Figure().add_subplot()
        >>> label_heatmap_axes(ax, ["", "fc1", "fc2"], list(range(0, 50, 2)))
        >>> [t.get_text() for t in ax.get_yticklabels()], [t.get_text() for t in ax.get_xticklabels()]
        (['(root)', 'fc1', 'fc2'], ['0', '6', '12', '18', '24', '30', '36', '42', '48'])
    """
    rows_at = _tick_positions(len(names), _MAX_ROW_LABELS)
    ax.set_yticks(list(rows_at), [names[i] or "(root)" for i in rows_at], fontsize=8)
    cols_at = _tick_positions(len(steps), _MAX_COL_LABELS)
    ax.set_xticks(list(cols_at), [str(steps[i]) for i in cols_at])


def heatmap_figure(log: HealthLog, stat: str) -> Any:
    """A matplotlib ``Figure`` with the heatmap of ``stat``, not yet saved.

    Zeros, NaN/Inf and steps at which a layer was not logged are masked (drawn grey), because a log scale has no
    place for them. A statistic with negative values uses a symmetric log scale instead.

    Args:
        log: The run's statistics.
        stat: A per-layer statistic present in ``log.stats``.

    Raises:
        MissingExtraError: If matplotlib is not installed.
        KeyError: If ``stat`` is not in ``log.stats``.

    Example:
        >>> from lightning_hookdiag.report.health_log import Scalar, build_health_log
        >>> log = build_health_log([Scalar("layer_health/act_absmax/fc", s, 2.0**s) for s in range(3)])
        >>> fig = heatmap_figure(log, "act_absmax")
        >>> fig.axes[0].images[0].get_array().shape
        (1, 3)
    """
    mpl = load_matplotlib()
    np = mpl.np
    names, steps, rows = log.matrix(stat)
    data = np.array(rows, dtype=float).reshape(len(names), len(steps))
    norm, mask, scale, grey_note = _norm_and_mask(mpl, data)

    width = min(16.0, max(6.0, 3.0 + 0.25 * len(steps)))
    height = min(40.0, max(3.0, 1.5 + 0.22 * len(names)))
    fig = mpl.Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    cmap = mpl.colormaps["viridis"].with_extremes(bad=_MISSING_COLOUR)
    image = ax.imshow(
        np.ma.masked_array(data, mask=mask),
        cmap=cmap,
        norm=norm,
        aspect="auto",
        interpolation="nearest",
        origin="upper",
    )
    label_heatmap_axes(ax, names, steps)
    unit = "parameter" if log.is_parameter_stat(stat) else "layer"
    ax.set_xlabel("optimizer step (sampled)")
    ax.set_ylabel(f"{unit} (forward order, shallow at top)")
    fig.suptitle(f"{log.prefix}/{stat}")
    ax.set_title(grey_note, fontsize=8)
    fig.colorbar(image, ax=ax, label=f"{stat} ({scale})")
    return fig


def plot_heatmap(log: HealthLog, stat: str, out: str | os.PathLike[str], dpi: int = 100) -> Path:
    r"""Save the heatmap of ``stat`` (see :func:`heatmap_figure`) as an image file.

    Args:
        log: The run's statistics.
        stat: A per-layer statistic present in ``log.stats``.
        out: The image path; its suffix picks the format (``.png``).
        dpi: Resolution of the saved image.

    Returns:
        ``out`` as a ``Path``.

    Raises:
        MissingExtraError: If matplotlib is not installed.
        OSError: If the file cannot be written.

    Example:
        >>> import tempfile
        >>> from lightning_hookdiag.report.health_log import Scalar, build_health_log
        >>> log = build_health_log([Scalar("layer_health/act_absmax/fc", s, 2.0**s) for s in range(3)])
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = plot_heatmap(log, "act_absmax", Path(tmp) / "h.png")
        ...     path.read_bytes()[:4]
        b'\x89PNG'
    """
    fig = heatmap_figure(log, stat)
    out = Path(out)
    fig.savefig(out, dpi=dpi)
    return out
