"""Real Lightning loggers: what ``LayerHealthCallback`` logged is read back from the logger's own storage.

Every test runs a real ``Trainer.fit`` with gradient accumulation (2 micro-batches per optimizer step, so optimizer
steps and batch indices differ) and ``every_n_steps=2`` over 5 optimizer steps: steps 0, 2 and 4 are sampled. A
``Recorder`` placed *after* the health callback copies ``last_metrics`` each time a new step is logged; the test
then reads the logger's files (CSV, TensorBoard event files, an MLflow file store, a W&B offline run) and checks
that exactly those keys and values were stored, under exactly the sampled optimizer steps.
"""

from __future__ import annotations

import csv
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from helpers import TinyModule, by_name, finish_wandb, make_data, make_trainer, offline_wandb_logger
from helpers.keys import parse_key
from helpers.offline_wandb import read_wandb_records
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import nn

from lightning_hookdiag import LayerHealthCallback

EVERY = 2
MAX_STEPS = 5
SAMPLED = [0, 2, 4]
PREFIX = "layer_health"
# Logged beside the statistics in the same call, not kept in last_metrics (the findings' tests read it).
COUNT = f"{PREFIX}/alerts_active"
# Characters MLflow accepts in a metric name; Lightning's MLFlowLogger strips anything else (with a warning).
MLFLOW_KEY = re.compile(r"[A-Za-z0-9_/. -]+")


class Net(nn.Module):
    """Nested names of every kind a real model has: list indices, Sequential indices, a ModuleDict key."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8), nn.Tanh())]
        )
        self.heads = nn.ModuleDict({"out-proj": nn.Linear(8, 1)})

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return self.heads["out-proj"](x)


class Recorder(Callback):
    """Copies the health callback's ``last_metrics`` whenever it has logged a new step.

    Must come after the health callback in ``callbacks``, so its ``on_train_batch_end`` runs after the one that logs.
    """

    def __init__(self, health: LayerHealthCallback) -> None:
        self.health = health
        self.per_step: dict[int, dict[str, float]] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self.health.last_step
        if step is not None and step not in self.per_step:
            # The values describe optimizer step `step`, whose optimizer has just stepped.
            assert trainer.global_step == step + 1
            self.per_step[step] = dict(self.health.last_metrics)


def fit(logger: Logger) -> dict[int, dict[str, float]]:
    """Train with ``logger`` and return the values the callback logged, by sampled optimizer step."""
    health = LayerHealthCallback(every_n_steps=EVERY, on_anomaly="ignore")
    recorder = Recorder(health)
    module = TinyModule(model=Net(), data=make_data(n=32), batch_size=8)
    module.record_enabled = False
    trainer = make_trainer([health, recorder], max_steps=MAX_STEPS, logger=logger, accumulate_grad_batches=2)
    trainer.fit(module)
    assert sorted(recorder.per_step) == SAMPLED
    assert health.last_step == SAMPLED[-1]
    assert recorder.per_step[SAMPLED[-1]] == health.last_metrics
    for metrics in recorder.per_step.values():
        # A broad selection: every stat kind and every kind of nested name is present.
        named = by_name(metrics)
        assert f"{PREFIX}/act_mean/model.heads.out-proj" in named
        assert f"{PREFIX}/act_dead_frac/model.blocks.0.1" in named
        assert f"{PREFIX}/param_update_ratio/model.blocks.1.0.weight" in named
        assert f"{PREFIX}/grad_norm_total" in named
        assert all(parse_key(k, PREFIX) is not None for k in metrics)
        assert all(math.isfinite(v) for v in metrics.values())
    return recorder.per_step


def is_statistic(key: str) -> bool:
    """A key of the callback's statistics (what ``last_metrics`` holds), as logged."""
    return parse_key(key, PREFIX) is not None and key != COUNT


def ours(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if is_statistic(k)}


# ------------------------------------------------------------------------------------------------------ CSV
def test_csv_logger_stores_every_sampled_step(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="csv")
    expected = fit(logger)

    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        rows = list(reader)
    assert {k for k in header if is_statistic(k)} == set().union(*expected.values())
    assert COUNT in header
    stored: dict[int, dict[str, float]] = {}
    for row in rows:
        values = {k: float(v) for k, v in ours(row).items() if v != ""}
        if values:
            step = int(row["step"])
            assert step not in stored, f"step {step} logged twice"
            stored[step] = values
    # The CSV holds Python's repr of each float: the read-back is exact.
    assert stored == expected


# ------------------------------------------------------------------------------------------------ TensorBoard
def test_tensorboard_logger_stores_every_sampled_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    import numpy as np
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    expected = fit(logger)  # fit ends with logger.finalize(), which flushes and closes the event file

    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if is_statistic(t)]
    # Tags are the keys unchanged (TensorBoard does not rewrite '.', '-' or '/').
    assert set(tags) == set().union(*expected.values())
    stored: dict[int, dict[str, float]] = {}
    for tag in tags:
        for event in acc.Scalars(tag):
            assert tag not in stored.setdefault(event.step, {}), f"{tag} logged twice at step {event.step}"
            stored[event.step][tag] = event.value
    assert sorted(stored) == SAMPLED
    # Event files hold float32 scalars.
    as_float32 = {s: {k: float(np.float32(v)) for k, v in m.items()} for s, m in expected.items()}
    assert stored == as_float32


# ------------------------------------------------------------------------------------------------------ MLflow
def test_mlflow_logger_stores_every_sampled_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    # MLflow >= 3.7 refuses the file store unless asked; a database store needs SQLAlchemy, which mlflow-skinny lacks.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    uri = (tmp_path / "mlruns").as_uri()
    logger = MLFlowLogger(experiment_name="hookdiag", tracking_uri=uri)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        expected = fit(logger)
    # MLFlowLogger rewrites keys with characters MLflow rejects, with this warning; none may have been rewritten.
    assert not [w for w in caught if "MLFlow only allows" in str(w.message)]
    keys = set().union(*expected.values())
    assert all(MLFLOW_KEY.fullmatch(k) and len(k) <= 250 for k in keys), sorted(keys)

    client = MlflowClient(tracking_uri=uri)
    assert set(ours(client.get_run(logger.run_id).data.metrics)) == keys
    for key in keys:
        history = client.get_metric_history(logger.run_id, key)
        stored = {m.step: m.value for m in history}
        assert len(history) == len(stored), f"{key}: a step logged twice"
        assert stored == {s: m[key] for s, m in expected.items() if key in m}, key


def test_wandb_offline_logger_stores_every_sampled_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logger = offline_wandb_logger(tmp_path, monkeypatch)
    from wandb.proto import wandb_internal_pb2

    try:
        expected = fit(logger)
    finally:
        finish_wandb()

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    stored: dict[int, dict[str, float]] = {}
    for raw in read_wandb_records(run_file):
        record = wandb_internal_pb2.Record.FromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        values = ours(row)
        if values:
            # WandbLogger logs Lightning's step as the metric "trainer/global_step" (W&B's own _step counts rows).
            step = row["trainer/global_step"]
            assert step not in stored, f"step {step} logged twice"
            stored[step] = values
    # W&B stores JSON numbers: float64 round-trips exactly (0.0 comes back as the int 0, which compares equal).
    assert stored == expected
