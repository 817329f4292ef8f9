"""Inside a real fit, LayerHealthCallback writes what it found into the loggers, and they hold it.

A module makes NaN on optimizer step 5 (between sampled steps 4 and 6): the sentinel trips, the step is replayed and
the rule ``nonfinite`` names the module. The trip and the finding, the count of active alerts and, at the end of
training, the heatmap of ``act_std`` reach CSV and TensorBoard; both are read back with their own readers (the
expected image is drawn from the values ``metrics.csv`` holds), and the report reader still finds the statistics
beside the new keys.
"""

from __future__ import annotations

import csv
import io
import math
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
from helpers import TinyModule, finish_wandb, make_data, make_trainer, offline_wandb_logger
from helpers.keys import parse_key
from helpers.png import decode_png
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._heatmap_image import NONFINITE, render
from lightning_hookdiag.report import read_health_log
from lightning_hookdiag.report._findings_file import read_findings

NAN_STEP = 5
SICK = "model.3"  # Linear, ReLU, Linear, <sick>, ReLU, Linear
STAT = "act_std"


class NaNAt(nn.Module):
    """Identity, except NaN in every output on optimizer step ``step`` (the module's ``global_step``)."""

    def __init__(self, owner: list[pl.LightningModule], step: int) -> None:
        super().__init__()
        self.owner, self.step = owner, step

    def forward(self, x: Any) -> Any:
        return x * float("nan") if self.owner[0].global_step == self.step else x


def sick_module() -> TinyModule:
    owner: list[pl.LightningModule] = []
    model = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), NaNAt(owner, NAN_STEP), nn.ReLU(), nn.Linear(8, 1)
    )
    module = TinyModule(model=model, data=make_data(n=64), lr=0.05)
    module.record_enabled = False
    owner.append(module)
    return module


def logged_columns(csv_dir: str, stat: str) -> dict[int, dict[str, float]]:
    """``{step: {layer: value}}`` of one statistic, read back from ``metrics.csv``, layers in logged order."""
    columns: dict[int, dict[str, float]] = {}
    with open(Path(csv_dir) / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, cell in row.items():
                parsed = parse_key(key, "layer_health")
                if parsed is not None and parsed.stat == stat and parsed.name is not None and cell:
                    columns.setdefault(int(row["step"]), {})[parsed.name] = float(cell)
    return columns


def test_a_fit_publishes_its_trip_finding_count_and_heatmap_to_csv_and_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    health = LayerHealthCallback(
        every_n_steps=2, on_anomaly="ignore", output={"summary": False, "heatmap_stats": [STAT]}
    )
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    make_trainer([health], max_steps=NAN_STEP + 1, logger=[csv_logger, tb_logger]).fit(sick_module())
    columns = logged_columns(csv_logger.log_dir, STAT)
    forward = list(columns[0])  # logged in forward order
    matrix = [[column.get(layer) for column in columns.values()] for layer in forward]

    # What the callback found: the trip and the finding at the module that made the NaN, both on step 5.
    trip = health.trips[0]
    assert (trip.step, trip.kind, trip.replayed) == (NAN_STEP, "nonfinite_loss", True)
    first = health.findings[0]
    assert (first.rule, first.step, first.layer) == ("nonfinite", NAN_STEP, SICK)
    expected = [("trip", t.step, t.kind) for t in health.trips] + [("finding", f.step, f.rule) for f in health.findings]

    for log_dir in (csv_logger.log_dir, tb_logger.log_dir):
        records = read_findings(log_dir)
        assert [(r["kind"], r["step"], r["rule"]) for r in records] == expected
        assert records[1]["layer"] == SICK
        assert math.isnan(records[0]["loss"])

    evaluated = sorted(columns)
    assert evaluated == [0, 2, 4, NAN_STEP]
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["layer_health/alerts_active"]]
    counts = {int(r["step"]): float(r["layer_health/alerts_active"]) for r in rows}
    assert len(rows) == len(counts)
    assert sorted(counts) == evaluated
    assert counts[NAN_STEP] == len(health.last_findings) >= 1  # the step's findings, the nonfinite one at least
    assert all(counts[s] == 0 for s in evaluated[:-1])
    png = Path(csv_logger.log_dir) / f"layer_health_heatmap_{STAT}_step{NAN_STEP:06d}.png"
    image = decode_png(png.read_bytes())
    cell = image.shape[0] // len(forward)  # square cells, one row per layer, one column per sampled step
    assert cell >= 4
    assert image.shape[:2] == (cell * len(forward), cell * len(columns))
    assert (image == render(matrix, cell=cell)).all()
    # The NaN column: the sick module's row is red.
    sick_row = forward.index(SICK)
    assert tuple(int(v) for v in image[cell * sick_row, -1]) == NONFINITE

    acc = EventAccumulator(tb_logger.log_dir, size_guidance={"tensors": 0, "scalars": 0, "images": 0})
    acc.Reload()
    (text,) = acc.Tensors("layer_health_findings/text_summary")
    assert text.step == NAN_STEP
    assert f"**step {NAN_STEP} · nonfinite · {SICK}** (forward, value " in text.tensor_proto.string_val[0].decode()
    assert [e.step for e in acc.Scalars("layer_health/alerts_active")] == evaluated
    (tb_image,) = acc.Images(f"layer_health_heatmap/{STAT}")
    pil = pytest.importorskip("PIL.Image")
    with pil.open(io.BytesIO(tb_image.encoded_image_string)) as decoded:
        assert (np.asarray(decoded.convert("RGB")) == image).all()

    # The report still reads the statistics: the alert count's key is outside the statistics' prefix.
    log = read_health_log(csv_logger.log_dir)
    assert log.prefix == "layer_health"


def test_a_healthy_fit_says_in_tensorboard_and_mlflow_that_nothing_was_found(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"file:{tmp_path / 'mlruns'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3.7+ refuses a file store without it
        tb_logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
        mlflow_logger = MLFlowLogger(experiment_name="healthy", tracking_uri=uri)
        health = LayerHealthCallback(every_n_steps=2, output={"summary": False})
        module = TinyModule(data=make_data(n=64))
        module.record_enabled = False
        make_trainer([health], max_steps=5, logger=[tb_logger, mlflow_logger]).fit(module)
        tags = MlflowClient(tracking_uri=uri).get_run(mlflow_logger.run_id).data.tags
    assert health.findings == []
    assert health.trips == []
    acc = EventAccumulator(tb_logger.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    (text,) = acc.Tensors("layer_health_findings/text_summary")
    assert text.step == health.last_step == 4
    assert text.tensor_proto.string_val[0].decode().startswith("No findings: every rule stayed silent")
    assert tags["layer_health.summary"].startswith("No findings")
    assert read_findings(tb_logger.log_dir) == []  # no record of a finding or a trip


def test_a_run_with_a_finding_gets_no_all_clear(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    health = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False})
    make_trainer([health], max_steps=NAN_STEP + 1, logger=[tb_logger]).fit(sick_module())
    acc = EventAccumulator(tb_logger.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("layer_health_findings/text_summary")]
    assert texts
    assert not [t for t in texts if t.startswith("No findings")]


def test_wandb_without_pillow_says_once_that_the_heatmap_is_not_drawn_and_the_fit_ends_well(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_hookdiag import LayerHealthWarning

    logger = offline_wandb_logger(tmp_path, monkeypatch)
    monkeypatch.setitem(sys.modules, "PIL", None)  # wandb.Image draws with Pillow: as if it were not installed
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    health = LayerHealthCallback(every_n_steps=2, output={"summary": False, "heatmap_every_n_steps": 2})
    module = TinyModule(data=make_data(n=64))
    module.record_enabled = False
    try:
        with pytest.warns(LayerHealthWarning, match="heatmap is not drawn there.*pillow") as record:
            make_trainer([health], max_steps=5, logger=[logger]).fit(module)
    finally:
        finish_wandb()
    notes = [w for w in record if "heatmap is not drawn" in str(w.message)]
    assert len(notes) == 1  # drawn on steps 0, 2 and 4, for two statistics: said once
    assert health.last_step == 4


def test_heatmaps_drawn_on_schedule_are_not_drawn_again_at_the_end(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    health = LayerHealthCallback(
        every_n_steps=2, output={"summary": False, "heatmap_stats": [STAT], "heatmap_every_n_steps": 2}
    )
    module = TinyModule(data=make_data(n=64))
    module.record_enabled = False
    make_trainer([health], max_steps=5, logger=[tb_logger]).fit(module)
    acc = EventAccumulator(tb_logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    assert [image.step for image in acc.Images(f"layer_health_heatmap/{STAT}")] == [0, 2, 4]
