"""Reading a run folder written by Lightning's ``CSVLogger`` or ``TensorBoardLogger`` into a :class:`HealthLog`."""

from __future__ import annotations

import csv
import io
import math
import os
import warnings
from pathlib import Path

from lightning_hookdiag._errors import MissingExtraError, ReportError, ReportWarning
from lightning_hookdiag.report._health_log import HealthLog, Scalar, build_health_log

__all__ = ["find_log_files", "read_csv_scalars", "read_health_log", "read_tensorboard_scalars"]

_CSV_NAME = "metrics.csv"
_EVENTS_GLOB = "events.out.tfevents.*"
_TENSORBOARD_HINT = "reading TensorBoard event files needs tensorboard: pip install 'lightning-hookdiag[loggers]'"
# How far below LOG_DIR to look for run folders when LOG_DIR itself holds no logs (save_dir/name/version_N).
_SEARCH_DEPTH = 3


def _is_log_file(path: Path) -> bool:
    return path.name == _CSV_NAME or path.match(_EVENTS_GLOB)


def find_log_files(path: str | os.PathLike[str]) -> list[Path]:
    """The log files of a run folder (a logger's ``log_dir``), ``metrics.csv`` first, or the one log file it names."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path}: no such file or folder")
    if path.is_file():
        if not _is_log_file(path):
            raise ReportError(f"{path}: not a {_CSV_NAME} or {_EVENTS_GLOB} file")
        return [path]
    if not path.is_dir():
        raise ReportError(f"{path}: not a folder")
    found = [path / _CSV_NAME] if (path / _CSV_NAME).is_file() else []
    found += sorted(p for p in path.glob(_EVENTS_GLOB) if p.is_file())
    if found:
        return found
    message = f"{path}: no {_CSV_NAME} or {_EVENTS_GLOB} files (expected a logger's log_dir)"
    runs = []
    for folder, subdirs, files in os.walk(path):
        if len(Path(folder).relative_to(path).parts) >= _SEARCH_DEPTH:
            subdirs.clear()
        if any(_is_log_file(Path(f)) for f in files):
            runs.append(Path(folder))
    if runs:
        shown = ", ".join(str(r) for r in sorted(runs)[:5]) + (", ..." if len(runs) > 5 else "")
        message += f"; run folders below it: {shown}"
    raise ReportError(message)


def _to_float(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def read_csv_scalars(path: str | os.PathLike[str]) -> list[Scalar]:
    r"""Every numeric cell of a CSVLogger ``metrics.csv``, with the ``step`` of its row.

    A row holds the keys of one ``log_metrics`` call and leaves the other columns empty; several rows may share a
    step. Non-numeric cells are skipped. A last row without its line end (a run still writing the file) is left
    out with a :class:`~lightning_hookdiag.report.ReportWarning` (why: ``docs/report.md``).

    Raises:
        ReportError: If the file cannot be read or has no ``step`` column.
    """
    scalars = []
    try:
        with open(path, newline="", encoding="utf-8") as file:
            text = file.read()
        if text and not text.endswith(("\n", "\r")):
            end = max(text.rfind("\n"), text.rfind("\r")) + 1
            what, part = ("its header is incomplete", "file") if end == 0 else ("its last row has no line end", "row")
            message = f"{path}: {what} (is the run still writing it?); that {part} was skipped"
            warnings.warn(message, ReportWarning, stacklevel=2)
            text = text[:end]
        reader = csv.DictReader(io.StringIO(text, newline=""))
        if reader.fieldnames is None:  # an empty file: the logger never saved a row
            return []
        if "step" not in reader.fieldnames:
            raise ReportError(f"{path}: no 'step' column; not a Lightning CSVLogger {_CSV_NAME}")
        for row in reader:
            step = _to_float(row.get("step") or "")
            if step is None or not math.isfinite(step):
                continue
            for key, cell in row.items():
                # A ragged row puts its extra cells under the key None, as a list.
                if key is None or key == "step" or not isinstance(cell, str) or not cell:
                    continue
                if (value := _to_float(cell)) is not None:
                    scalars.append(Scalar(key, int(step), value))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ReportError(f"{path}: cannot read it as CSV ({exc})") from exc
    return scalars


def read_tensorboard_scalars(path: str | os.PathLike[str]) -> list[Scalar]:
    """Every scalar of one TensorBoard event file, both old-style ``simple_value`` and scalar-plugin tensors."""
    try:
        # Importing the top-level package first makes a blocked or missing tensorboard fail here even when
        # the submodule is already cached.
        import tensorboard  # noqa: F401
        from tensorboard.backend.event_processing import event_accumulator as ea
        from tensorboard.util import tensor_util  # already loaded by event_accumulator's imports
    except ImportError as exc:
        raise MissingExtraError(_TENSORBOARD_HINT) from exc
    # purge_orphaned_data=False: Lightning may log train_loss at a later step before the callback logs the step it
    # describes, which TensorBoard's restart heuristics would otherwise treat as orphaned data and drop.
    acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0}, purge_orphaned_data=False)
    try:
        acc.Reload()
        tags = acc.Tags()
        scalars = [Scalar(t, int(e.step), float(e.value)) for t in tags.get(ea.SCALARS, []) for e in acc.Scalars(t)]
        for tag in tags.get(ea.TENSORS, []):
            if acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
                continue
            for event in acc.Tensors(tag):
                array = tensor_util.make_ndarray(event.tensor_proto)
                if array.size == 1 and array.dtype.kind in "fiub":
                    scalars.append(Scalar(tag, int(event.step), float(array.reshape(-1)[0])))
    except Exception as exc:  # tensorboard raises its own DataLossError and protobuf errors on damaged files
        raise ReportError(f"{path}: cannot read it as a TensorBoard event file ({exc})") from exc
    return scalars


def read_health_log(path: str | os.PathLike[str], prefix: str | None = None) -> HealthLog:
    r"""Read the health statistics of one run (as :func:`find_log_files` finds its files) under the callback's prefix.

    Args:
        path: A run folder (a logger's ``log_dir``) or one log file.
        prefix: The callback's ``prefix=``; ``None`` detects it (:func:`~lightning_hookdiag.report.detect_prefix`).

    Raises:
        ReportError: If the path holds no logs or no health statistics under the prefix.
        MissingExtraError: If event files are present but tensorboard is not installed.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = (Path(tmp) / "metrics.csv").write_text(
        ...         "layer_health/act_std/b,layer_health/depth/a,layer_health/depth/b,step,train_loss\n"
        ...         ",1.0,0.0,7,\n0.5,,,7,\n,,,7,0.25\n"
        ...     )
        ...     log = read_health_log(tmp)
        >>> log.prefix, log.steps, log.stats, log.depth
        ('layer_health', (7,), {'act_std': {'b': {7: 0.5}}}, {'a': 1, 'b': 0})
    """
    files = find_log_files(path)
    scalars = [s for f in files for s in (read_csv_scalars(f) if f.name == _CSV_NAME else read_tensorboard_scalars(f))]
    log = build_health_log(scalars, prefix)
    if log.empty:
        shown = ", ".join(str(f) for f in files)
        hint = "" if scalars else " (the logs hold no numeric values)"
        raise ReportError(
            f"no '{log.prefix}/...' keys in {shown}{hint}; was LayerHealthCallback attached and did it sample a step"
            " (if it was given another prefix=, pass --prefix)?"
        )
    return log
