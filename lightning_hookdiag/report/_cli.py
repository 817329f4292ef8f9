"""The ``hookdiag`` command line, ``hookdiag report LOG_DIR`` and ``hookdiag report --diff RUN_A RUN_B``.

What the command prints and its exit status: ``docs/report.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning_hookdiag._errors import MissingExtraError, ReportError, ReportWarning
from lightning_hookdiag.report._diff import align, find_differences, format_diff, ratio_figure
from lightning_hookdiag.report._findings_file import FINDINGS_FILE, format_findings, read_findings
from lightning_hookdiag.report._health_log import HealthLog, build_health_log
from lightning_hookdiag.report._mlflow_run import is_mlflow_run, read_mlflow_findings, read_mlflow_scalars
from lightning_hookdiag.report._plot import heatmap_figure
from lightning_hookdiag.report._reading import read_health_log
from lightning_hookdiag.report._summary import format_summary

__all__ = ["DEFAULT_STAT", "build_parser", "main"]

DEFAULT_STAT = "act_grad_norm"
_PROG = "hookdiag"
# argparse's own convention for usage errors, kept for ours so that every failure looks alike to scripts.
_EXIT_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hookdiag`` and its ``report`` sub-command."""
    parser = argparse.ArgumentParser(prog=_PROG, description="Layer health diagnostics for Lightning runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="summarise and plot the statistics a LayerHealthCallback logged",
        description="Print a per-layer summary of one statistic (layers in forward order) and save its heatmap. "
        "Reads a CSVLogger metrics.csv and/or TensorBoardLogger event files, or an MLflow run (mlflow:<run id>).",
    )
    report.add_argument(
        "log_dir",
        metavar="LOG_DIR",
        nargs="?",
        help="the logger's log_dir (e.g. lightning_logs/version_0), or mlflow:<run id> for an MLflow run",
    )
    report.add_argument(
        "--stat",
        help=f"statistic to report (default: {DEFAULT_STAT}; with --diff, that of the first difference)",
    )
    report.add_argument(
        "--out",
        help="heatmap file; its suffix picks the format (none: .png), an existing folder gets the default name inside"
        " it (default: LOG_DIR/layer_health_<stat>.png; with --diff, RUN_B/layer_health_diff_<stat>.png)",
    )
    report.add_argument("--prefix", help="the callback's prefix= (default: detected from the logs)")
    report.add_argument(
        "--tracking-uri",
        help="the MLflow tracking store of mlflow:<run id> runs (default: MLFLOW_TRACKING_URI, else MLflow's own)",
    )
    report.add_argument(
        "--diff",
        nargs=2,
        metavar=("RUN_A", "RUN_B"),
        help="compare two runs: print the first (step, layer, statistic) where they differ, in depth order, and"
        " draw the B/A ratio heatmap of --stat; exit status 1 if they differ, 0 if not",
    )
    report.add_argument("--rtol", type=float, default=1e-4, help="--diff: relative tolerance (default: 0.0001)")
    report.add_argument("--atol", type=float, default=0.0, help="--diff: absolute tolerance (default: 0)")
    return parser


def _check_out(out: str | None) -> None:
    """Refuse an ``--out`` suffix matplotlib cannot write, before any log is read (no suffix: ``.png``, a folder)."""
    if out is None or Path(out).is_dir() or not Path(out).suffix:
        return
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # nothing to check against; drawing fails later, naming the extra to install
        return
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(out).suffix
    if suffix[1:].lower() not in formats:  # savefig reads the format from the suffix in lower case
        listed = ", ".join(f".{name}" for name in formats)
        raise ReportError(f"--out {out}: unsupported suffix {suffix!r}; the heatmap can be written as {listed}")


def _out_path(out: str | None, run: Path, name: str) -> Path:
    """The file the heatmap goes to: ``--out`` as given, with ``.png`` when it has no suffix, or inside a folder."""
    default = f"layer_health_{name}.png"
    if out is None:
        path = (run if run.is_dir() else run.parent) / default
    elif Path(out).is_dir():  # an existing folder: the default file name inside it
        path = Path(out) / default
    elif not Path(out).suffix:  # matplotlib would add .png itself; adding it here lets the path printed be the file
        path = Path(out + ".png")
    else:
        path = Path(out)
    if not path.parent.is_dir():
        raise ReportError(f"{path}: the folder {path.parent} does not exist")
    return path


def _save(figure: Any, out: Path, what: str) -> None:
    try:
        figure.savefig(out, dpi=100)  # the suffix picks the format
    except OSError as exc:
        raise ReportError(f"{out}: cannot write the heatmap ({exc.strerror or exc})") from exc
    print(f"{what}: {out}")


def _report(args: argparse.Namespace) -> int:
    _check_out(args.out)
    if args.diff is not None:
        if args.log_dir is not None:
            raise ReportError(f"give LOG_DIR or --diff RUN_A RUN_B, not both (got LOG_DIR {args.log_dir})")
        return _diff(args)
    if args.log_dir is None:
        raise ReportError("expected LOG_DIR, or --diff RUN_A RUN_B")
    args.stat = args.stat or DEFAULT_STAT
    log = _read_log(args.log_dir, args)
    if args.stat not in log.stats:
        present = ", ".join(log.stat_names) or "none"
        if args.stat in log.totals:
            raise ReportError(
                f"'{args.stat}' is one number per step, not per layer (see the summary); per-layer stats: {present}"
            )
        raise ReportError(f"stat '{args.stat}' is not in the logs of {args.log_dir}; stats present: {present}")
    out = _out_path(args.out, _folder_of(args.log_dir), args.stat)
    print(format_summary(log, args.stat))
    print(_findings_text(args.log_dir, log.prefix, args))
    # The summary is printed first: it is useful even when the plot then fails for want of matplotlib.
    _save(heatmap_figure(log, args.stat), out, "heatmap")
    return 0


def _read_log(source: str, args: argparse.Namespace) -> HealthLog:
    """The health log of a log folder or file, or of an MLflow run (``mlflow:<run id>``)."""
    if not is_mlflow_run(source):
        return read_health_log(source, prefix=args.prefix)
    log = build_health_log(read_mlflow_scalars(source, args.tracking_uri), args.prefix)
    if log.empty:
        raise ReportError(f"no '{log.prefix}/...' metrics in the MLflow run {source}; was LayerHealthCallback there?")
    return log


def _folder_of(source: str) -> Path:
    """Where a heatmap goes by default: beside the logs, or the current folder for an MLflow run."""
    return Path.cwd() if is_mlflow_run(source) else Path(source)


def _findings_text(source: str, prefix: str, args: argparse.Namespace) -> str:
    """The run's findings and trips as the callback wrote them beside its logs, or a line saying there are none."""
    if is_mlflow_run(source):
        records = read_mlflow_findings(source, prefix, args.tracking_uri)
    else:
        path = Path(source)
        records = read_findings(path if path.is_dir() else path.parent)
    if not records:
        return f"no findings or sentinel trips recorded ({FINDINGS_FILE} is absent or empty)"
    return f"findings and sentinel trips ({len(records)}, from {FINDINGS_FILE}):\n{format_findings(records)}"


def _tolerance(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ReportError(f"--{name}: expected a finite number >= 0, got {value}")
    return value


def _diff(args: argparse.Namespace) -> int:
    rtol, atol = _tolerance("rtol", args.rtol), _tolerance("atol", args.atol)
    run_a, run_b = args.diff
    alignment = align(_read_log(run_a, args), _read_log(run_b, args))
    differences = find_differences(alignment, rtol=rtol, atol=atol)
    if args.stat is not None and args.stat not in alignment.names:
        common = ", ".join(alignment.names)
        raise ReportError(f"--stat {args.stat} is not logged by both runs; common statistics: {common}")
    stat = args.stat or (differences[0].stat if differences else DEFAULT_STAT)
    stat = stat if stat in alignment.names else next(iter(alignment.names))  # DEFAULT_STAT may not be a common one
    out = _out_path(args.out, _folder_of(run_b), f"diff_{stat}")
    print(f"RUN_A: {run_a}\nRUN_B: {run_b}")
    print(format_diff(alignment, differences, rtol, atol))
    _save(ratio_figure(alignment, stat), out, f"ratio heatmap (B/A of {stat})")
    return 1 if differences else 0  # as diff(1) and cmp(1): 0 when the inputs match, 1 when they differ


def _show_warning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    print(f"{_PROG}: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the ``hookdiag`` command line on ``argv`` (without the program name; ``None``: ``sys.argv``).

    Returns:
        The exit status: 0 on success, 2 on an error (one ``hookdiag: error: ...`` line on stderr, never a
        traceback); with ``--diff``, 1 when the runs differ.

    Example:
        >>> main(["report", "/no/such/run"])
        2
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already explained
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else _EXIT_ERROR
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", ReportWarning)
            warnings.showwarning = _show_warning  # restored when the block ends
            return _report(args)
    except (ReportError, MissingExtraError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return _EXIT_ERROR
    except BrokenPipeError:
        # The reader (``| head``) went away: not an error of ours. Point stdout at devnull so the interpreter's
        # final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
