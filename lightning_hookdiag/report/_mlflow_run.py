"""An MLflow run as a source of the report: its metric histories as scalars, its findings artifact as records.

A run is named ``mlflow:<run id>`` wherever the report takes a run folder (``LOG_DIR``, ``--diff RUN_A RUN_B``), and
found in the tracking store ``--tracking-uri`` names (default: MLflow's own, from ``MLFLOW_TRACKING_URI``). mlflow is
imported only here, only when such a run is read.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from lightning_hookdiag._errors import MissingExtraError, ReportError
from lightning_hookdiag.report._findings_file import FINDINGS_FILE
from lightning_hookdiag.report._health_log import Scalar

__all__ = ["MLFLOW_SCHEME", "is_mlflow_run", "read_mlflow_findings", "read_mlflow_scalars"]

MLFLOW_SCHEME = "mlflow:"
"""What starts a run given as an MLflow run id: ``mlflow:0123abcd...``."""


def is_mlflow_run(source: str) -> bool:
    """Whether ``source`` names an MLflow run (``mlflow:<run id>``) rather than a log folder or file.

    Example:
        >>> is_mlflow_run("mlflow:4f2b"), is_mlflow_run("lightning_logs/version_0")
        (True, False)
    """
    return source.startswith(MLFLOW_SCHEME)


def _client(tracking_uri: str | None) -> Any:
    """An ``MlflowClient`` for ``tracking_uri``; a file store is read as the run wrote it.

    mlflow 3.7 and later refuse a ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE`` is set; reading one that a run
    already wrote is what the report is for, so it is allowed here unless the user set the variable otherwise.
    """
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise MissingExtraError(
            "reading an MLflow run needs mlflow: pip install 'lightning-hookdiag[loggers]' (or mlflow-skinny)"
        ) from exc
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith("file:") or (uri and "://" not in uri):  # a plain path is a file store too
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=tracking_uri)


def _run(client: Any, source: str) -> Any:
    run_id = source[len(MLFLOW_SCHEME) :]
    if not run_id:
        raise ReportError(f"{source!r}: expected mlflow:<run id>")
    try:
        return client.get_run(run_id)
    except Exception as exc:  # mlflow raises its own MlflowException, with the store's wording
        raise ReportError(f"MLflow run {run_id!r} not found in {client.tracking_uri}: {exc}") from exc


def read_mlflow_scalars(source: str, tracking_uri: str | None = None) -> list[Scalar]:
    """Every metric of the run ``source`` names, with its whole history (step, value).

    Raises:
        ReportError: If the run does not exist in the store.
        MissingExtraError: If mlflow is not installed.
    """
    client = _client(tracking_uri)
    run = _run(client, source)
    run_id = run.info.run_id
    return [
        Scalar(key, int(metric.step), float(metric.value))
        for key in sorted(run.data.metrics)
        for metric in client.get_metric_history(run_id, key)
    ]


def read_mlflow_findings(source: str, prefix: str, tracking_uri: str | None = None) -> list[dict[str, Any]]:
    """The records of the run's findings artifact (``<prefix>/findings.jsonl``), in order; ``[]`` if it has none."""
    client = _client(tracking_uri)
    run_id = _run(client, source).info.run_id
    artifact = f"{prefix}/{FINDINGS_FILE}"
    if artifact not in {entry.path for entry in client.list_artifacts(run_id, prefix)}:
        return []
    with tempfile.TemporaryDirectory() as folder:
        local = Path(client.download_artifacts(run_id, artifact, folder))
        lines = local.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
