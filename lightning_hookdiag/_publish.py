"""What the rules and the sentinel conclude, written into Lightning loggers in each logger's native form.

The callback's logging half for everything that is not a scalar statistic: findings and sentinel trips as
TensorBoard text, MLflow tags and an artifact, a W&B table, or JSON lines in ``<log_dir>/findings.jsonl`` (CSV and
any logger with a ``log_dir``); the count of active alerts as a scalar (``<prefix>/alerts_active``, in the summary
group) to every logger; the heatmap as an image. Nothing here computes or decides: the caller passes each finding
once, on the step it is made. Every logger gets its share even when another one fails: the errors come back, one per
failing logger, for the caller to raise after the step. Only rank 0 writes (as Lightning's own ``log_metrics``), and
each logger's ``prefix`` applies as Lightning applies it to scalars. What each logger receives, and how to read it
back: ``docs/loggers.md``.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lightning.fabric.utilities.logger import _add_prefix

# From fabric, which defines and sets it; lightning.pytorch re-exports the same object without declaring the export.
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

from lightning_hookdiag._errors import MissingExtraError
from lightning_hookdiag._heatmap_image import as_rgb, png_bytes
from lightning_hookdiag._keys import ALERTS_ACTIVE, step_key
from lightning_hookdiag._step_state import Trip
from lightning_hookdiag._table import format_value
from lightning_hookdiag.report._findings_file import FINDINGS_FILE
from lightning_hookdiag.rules._findings import Finding

__all__ = [
    "COLUMNS",
    "FINDINGS_FILE",
    "FindingsWriter",
    "finding_record",
    "trip_message",
    "trip_record",
    "write_all_clear",
    "write_image",
]

COLUMNS = ("step", "rule", "layer", "phase", "value", "threshold", "message")
"""The columns of the TensorBoard and W&B tables: one row per finding or trip."""

# MLflow refuses more than 100 tags in one batch, and tag values over 8000 characters (older releases: 5000, the
# limit kept here).
_MLFLOW_TAG_CHARS = 5000
_MLFLOW_TAGS_PER_BATCH = 100


def trip_message(trip: Trip) -> str:
    """One sentence on a sentinel trip: the loss, what it was compared with, where a NaN/Inf came from, the replay."""
    if trip.kind == "loss_spike":
        baseline = "unknown" if trip.baseline is None else format_value(trip.baseline)
        said = f"the loss spiked to {format_value(trip.loss)} (baseline {baseline})"
    else:
        what = "loss" if trip.kind == "nonfinite_loss" else "loss or a gradient"
        since = "" if trip.last_finite_step is None else f" (last finite at step {trip.last_finite_step})"
        said = f"the {what} went non-finite{since}"
        if trip.nan_entry is not None:
            origin = trip.nan_origin or "code outside every module's forward"
            said += f"; the NaN/Inf was made by {origin}, first seen entering {trip.nan_entry}"
        if trip.bad_batch:
            tensors = ", ".join(f"{path} ({bad} of {total})" for path, bad, total in trip.bad_batch)
            said += f"; the batch holds NaN/Inf: {tensors}"
    replay = "replayed with hooks" if trip.replayed else f"not replayed: {trip.reason}"
    return f"sentinel tripped at step {trip.step}: {said}; {replay}"


def finding_record(finding: Finding) -> dict[str, Any]:
    """A finding as one JSON object (``"kind": "finding"`` and every field of :class:`Finding`)."""
    return {"kind": "finding", **vars(finding)}


def trip_record(trip: Trip) -> dict[str, Any]:
    """A trip as one JSON object: ``"kind": "trip"``, the trip's kind as ``"rule"``, its fields, and a message."""
    fields = {name: value for name, value in vars(trip).items() if name != "kind"}
    fields["bad_batch"] = [list(entry) for entry in trip.bad_batch]
    return {"kind": "trip", "rule": trip.kind, **fields, "message": trip_message(trip)}


def _row(record: dict[str, Any]) -> list[Any]:
    """A record as a table row (:data:`COLUMNS`); a trip's value is its loss, its threshold the spike's baseline."""
    if record["kind"] == "trip":
        layer = record["nan_origin"] or record["nan_entry"] or ""
        return [record["step"], record["rule"], layer, "", record["loss"], record["baseline"], record["message"]]
    return [record[column] for column in COLUMNS]


def _markdown(rows: list[list[Any]]) -> str:
    """Rows as Markdown for TensorBoard's text dashboard: per row, a bold heading line, then its message.

    A table would squeeze the seven columns into narrow ones beside a long message; a heading per finding reads as
    "step 0 · dead_units · net.61" with the sentence below it. ``*`` is escaped (Markdown emphasis).
    """

    def text(value: Any) -> str:
        shown = format_value(value) if isinstance(value, float) else ("" if value is None else str(value))
        return shown.replace("*", "\\*").replace("\n", " ")

    blocks = []
    for step, rule, layer, phase, value, threshold, message in (map(text, row) for row in rows):
        where = f" · {layer}" if layer else ""
        details = ", ".join(
            part for part in (phase, f"value {value}", f"threshold {threshold}" if threshold else "") if part
        )
        blocks.append(f"**step {step} · {rule}{where}** ({details})\n\n{message}")
    return "\n\n".join(blocks)


def _prefixed(logger: Logger, key: str) -> str:
    """``key`` as ``logger.log_metrics`` would store it (the logger's ``prefix``, joined as Lightning joins it)."""
    (stored,) = _add_prefix({key: 0.0}, getattr(logger, "_prefix", ""), getattr(logger, "LOGGER_JOIN_CHAR", "-"))
    return stored


def _append_lines(folder: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append ``records`` as JSON lines to ``<folder>/findings.jsonl`` (made if the logger has not written yet)."""
    path = Path(folder) / FINDINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def _mlflow_records(client: Any, run_id: str, artifact: str) -> list[dict[str, Any]]:
    """The records of the run's findings artifact so far (a run resumed with ``run_id=`` has some), or none."""
    folder = str(Path(artifact).parent)
    if artifact not in {info.path for info in client.list_artifacts(run_id, folder)}:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(client.download_artifacts(run_id, artifact, tmp)).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _tag_value(record: dict[str, Any]) -> str:
    """A finding or trip as an MLflow tag value: the step and the message, cut to MLflow's limit."""
    text = f"step {record['step']}: {record['message']}"
    return text if len(text) <= _MLFLOW_TAG_CHARS else text[: _MLFLOW_TAG_CHARS - 3] + "..."


class FindingsWriter:
    """Writes findings, trips and the active-alert count to loggers; remembers each run's findings so far.

    MLflow overwrites an artifact of the same name and a W&B table shows one logged version at a time, so both get
    the run's whole list each time (an MLflow run resumed with ``run_id=`` is read back first; a resumed W&B run
    starts a new table). Per logger, on each step it is called for:

    - every logger: ``<prefix>/alerts_active``, the number of active alerts (in the summary group);
    - TensorBoard: the step's new rows as a Markdown table, text tag ``<prefix>_findings``, and the JSON lines file;
    - MLflow: a tag ``<prefix>.finding.<n>`` per row (``n`` counts the run's rows) and ``<prefix>/findings.jsonl``;
    - W&B: a table ``<prefix>_findings`` of the run's rows, logged with the count;
    - any other logger with a ``log_dir`` (CSV): the JSON lines, appended to ``<log_dir>/findings.jsonl``.

    Args:
        prefix: The callback's ``prefix``: first segment of every key, tag and artifact written.
    """

    def __init__(self, prefix: str = "layer_health") -> None:
        self.prefix = prefix
        self._runs: dict[str, list[dict[str, Any]]] = {}  # run id -> the run's records so far (MLflow, W&B)

    def write(
        self,
        loggers: Sequence[Logger],
        step: int,
        findings: Sequence[Finding],
        trips: Sequence[Trip],
        *,
        active: int | None = None,
    ) -> list[BaseException]:
        """Write the ``findings`` and ``trips`` new at ``step``, and the count of ``active`` alerts, to ``loggers``.

        Args:
            loggers: The Trainer's loggers; each gets its share even when another one fails.
            step: The optimizer step the findings are about.
            findings: The findings new at ``step`` (each is written once).
            trips: The sentinel trips of ``step``.
            active: The count of active alerts, as a scalar; ``None``: no count (for a caller that logs it with its
                own scalars, in one row per step).

        Returns:
            The error of each logger that failed, after every other logger got the step.
        """
        if _global_rank() != 0:
            return []
        records = [trip_record(trip) for trip in trips] + [finding_record(finding) for finding in findings]
        errors: list[BaseException] = []
        for logger in loggers:
            try:
                self._write_one(logger, step, records, active)
            except Exception as error:  # the other loggers still get the step; the caller raises it after them
                errors.append(error)
        return errors

    def _write_one(self, logger: Logger, step: int, records: list[dict[str, Any]], active: int | None) -> None:
        metrics: dict[str, Any] = {} if active is None else {step_key(self.prefix, ALERTS_ACTIVE): float(active)}
        if records and isinstance(logger, WandbLogger):
            import wandb

            run = self._runs.setdefault(str(logger.experiment.id), [])
            run.extend(records)
            table = wandb.Table(columns=list(COLUMNS), data=[_row(record) for record in run])
            metrics[f"{self.prefix}_findings"] = table  # one history row with the count; log_metrics adds the prefix
        # First, so that a CSVLogger has made its folder (it warns about a folder that holds files before it).
        if metrics:
            logger.log_metrics(metrics, step=step)
        if not records or isinstance(logger, WandbLogger):
            return
        if isinstance(logger, TensorBoardLogger):
            text = _markdown([_row(record) for record in records])
            logger.experiment.add_text(_prefixed(logger, f"{self.prefix}_findings"), text, global_step=step)
            if (log_dir := _log_dir(logger)) is not None:  # beside the event files, for `hookdiag report`
                _append_lines(log_dir, records)
        elif isinstance(logger, MLFlowLogger):
            self._write_mlflow(logger, records)
        elif (log_dir := _log_dir(logger)) is not None:
            _append_lines(log_dir, records)

    def _write_mlflow(self, logger: MLFlowLogger, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import RunTag

        client, run_id = logger.experiment, logger.run_id
        artifact = _prefixed(logger, f"{self.prefix}/{FINDINGS_FILE}")
        if run_id is None:  # unreachable: .experiment (just read) starts the run and sets its id on rank 0
            raise RuntimeError(f"MLFlowLogger has no run id after starting its run; {artifact} is not written")
        if run_id not in self._runs:
            self._runs[run_id] = _mlflow_records(client, run_id, artifact)
        run = self._runs[run_id]
        tags = [
            RunTag(_prefixed(logger, f"{self.prefix}.finding.{len(run) + i:04d}"), _tag_value(record))
            for i, record in enumerate(records)
        ]
        for start in range(0, len(tags), _MLFLOW_TAGS_PER_BATCH):
            client.log_batch(run_id, tags=tags[start : start + _MLFLOW_TAGS_PER_BATCH])
        run.extend(records)
        client.log_text(run_id, "".join(json.dumps(record) + "\n" for record in run), artifact)


def write_all_clear(loggers: Sequence[Logger], prefix: str, step: int, text: str) -> list[BaseException]:
    """Say in the loggers with a text view that the run had no finding: TensorBoard text, an MLflow tag.

    A healthy run's dashboard then says so, instead of leaving the reader to infer it from an empty Text tab. CSV and
    W&B show the absence directly (no ``findings.jsonl``; an empty table is not logged), and get nothing.

    Returns:
        The error of each logger that failed, after every other logger got the text.
    """
    if _global_rank() != 0:
        return []
    errors: list[BaseException] = []
    for logger in loggers:
        try:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(_prefixed(logger, f"{prefix}_findings"), text, global_step=step)
            elif isinstance(logger, MLFlowLogger) and logger.run_id is not None:
                logger.experiment.set_tag(logger.run_id, _prefixed(logger, f"{prefix}.summary"), text)
        except Exception as error:  # the other loggers still get the text; the caller raises it after them
            errors.append(error)
    return errors


def _log_dir(logger: Logger) -> str | None:
    """The folder a logger writes its files into, as Lightning's file loggers give it (a string), else ``None``.

    Only a string counts: a stand-in logger (a ``Mock`` in a test) answers any attribute, and a ``MagicMock`` even
    converts to a path, so that files would be written under a folder named after the mock.
    """
    log_dir = getattr(logger, "log_dir", None)
    return log_dir if isinstance(log_dir, str) else None


def _global_rank() -> int:
    """This process's rank, as Lightning's own rank-zero-only logging reads it."""
    # Set at runtime on the function object (by lightning.fabric.utilities.rank_zero at import, then by the
    # Trainer's strategy); its overloaded type cannot declare the attribute.
    rank: int = rank_zero_only.rank  # type: ignore[attr-defined]
    return rank


def _has_pil() -> bool:
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        return False
    return True


def _image_file_name(tag: str, step: int) -> str:
    return f"{tag.replace('/', '_')}_step{step:06d}.png"


def _write_image_one(logger: Logger, tag: str, image: np.ndarray, step: int) -> None:
    key = _prefixed(logger, tag)
    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_image(key, image, global_step=step, dataformats="HWC")
    elif isinstance(logger, MLFlowLogger):
        if _has_pil():  # MLflow's step-indexed images (a slider in the run's UI) are drawn with PIL
            logger.experiment.log_image(logger.run_id, image, key=key, step=step)
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / _image_file_name(key, step)
            path.write_bytes(png_bytes(image))
            logger.experiment.log_artifact(logger.run_id, str(path), "images")
    elif isinstance(logger, WandbLogger):
        if not _has_pil():
            raise MissingExtraError("W&B images need pillow (wandb.Image draws with PIL): pip install pillow")
        logger.log_image(key, [image], step=step)
    else:
        log_dir = _log_dir(logger)
        if log_dir is None:
            return
        # A CSVLogger makes its folder here (it warns about a folder that already holds files). Logger declares no
        # experiment, though every Lightning logger with a log_dir has one: the access is duck-typed, as before.
        _ = logger.experiment  # type: ignore[attr-defined]
        folder = Path(log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / _image_file_name(key, step)).write_bytes(png_bytes(image))


def write_image(loggers: Sequence[Logger], tag: str, image: Any, step: int) -> list[BaseException]:
    """Write ``image`` (``H x W x 3`` ``uint8``, numpy or torch) under ``tag`` at ``step`` to every logger.

    TensorBoard: an image summary; MLflow: a step-indexed image (with PIL; without it a PNG artifact under
    ``images/``); W&B: a ``wandb.Image`` (needs PIL); any other logger with a ``log_dir``: the PNG
    ``<log_dir>/<tag with / as _>_step<step, 6 digits>.png``. Loggers with none of these are skipped.

    Returns:
        The error of each logger that failed, after every other logger got the image.

    Raises:
        ValueError: If ``image`` is not an ``H x W x 3`` ``uint8`` array.
    """
    pixels = as_rgb(image)
    if _global_rank() != 0:
        return []
    errors: list[BaseException] = []
    for logger in loggers:
        try:
            _write_image_one(logger, tag, pixels, step)
        except Exception as error:  # as in FindingsWriter.write: the other loggers first
            errors.append(error)
    return errors
