"""Inside a real fit: a callback of the test's own publishes what LayerHealthCallback found, and the loggers hold it.

A module makes NaN on optimizer step 5 (between sampled steps 4 and 6): the sentinel trips, the step is replayed and
the rule ``nonfinite`` names the module. After each evaluated step the test's ``Publish`` callback hands the new
findings and trips to :class:`FindingsWriter`, and at the end of training the heatmap of ``act_std`` to
:func:`write_image`. The CSV and TensorBoard logs are then read back with their own readers, and the report reader
still finds the statistics beside the new keys.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
from conftest import TinyModule, make_data, make_trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from test_heatmap_image import decode_png
from torch import nn

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.heatmap_image import NONFINITE, render
from lightning_hookdiag.publish import FindingsWriter, write_image
from lightning_hookdiag.report import read_health_log
from lightning_hookdiag.report.findings_file import read_findings

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


class Publish(Callback):
    """After each step the health callback logs: its new findings and trips to every logger; at the end, a heatmap."""

    def __init__(self, health: LayerHealthCallback) -> None:
        self.health = health
        self.writer = FindingsWriter(health.prefix)
        self.step: int | None = None
        self.findings = self.trips = 0
        self.columns: dict[int, dict[str, float]] = {}  # step -> layer -> STAT, as logged
        self.errors: list[BaseException] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self.health.last_step
        if step is None or step == self.step:
            return
        self.step = step
        findings, trips = self.health.findings[self.findings :], self.health.trips[self.trips :]
        self.findings, self.trips = len(self.health.findings), len(self.health.trips)
        active = len(self.health.last_findings) + sum(trip.step == step for trip in trips)
        self.errors += self.writer.write(trainer.loggers, step, findings, trips, active=active)
        head = f"{self.health.prefix}/{STAT}/"
        self.columns[step] = {k[len(head) :]: v for k, v in self.health.last_metrics.items() if k.startswith(head)}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.errors += write_image(trainer.loggers, f"{self.health.prefix}_heatmap/{STAT}", self.image(), self.step)

    def image(self) -> np.ndarray:
        layers = list(self.columns[min(self.columns)])  # logged in forward order
        return render([[column.get(layer) for column in self.columns.values()] for layer in layers], cell=2)


def test_a_fit_publishes_its_trip_finding_count_and_heatmap_to_csv_and_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    health = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", summary=False)
    publish = Publish(health)
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    make_trainer([health, publish], max_steps=NAN_STEP + 1, logger=[csv_logger, tb_logger]).fit(sick_module())
    assert publish.errors == []

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

    evaluated = sorted(publish.columns)
    assert evaluated == [0, 2, 4, NAN_STEP]
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["layer_health_alerts/active"]]
    counts = {int(r["step"]): float(r["layer_health_alerts/active"]) for r in rows}
    assert len(rows) == len(counts)
    assert sorted(counts) == evaluated
    assert counts[NAN_STEP] >= 2  # the trip and at least the nonfinite finding
    assert all(counts[s] == 0 for s in evaluated[:-1])
    png = Path(csv_logger.log_dir) / f"layer_health_heatmap_{STAT}_step{NAN_STEP:06d}.png"
    image = decode_png(png.read_bytes())
    assert (image == publish.image()).all()
    # The NaN column: the sick module's row is red.
    sick_row = list(publish.columns[0]).index(SICK)
    assert tuple(int(v) for v in image[2 * sick_row, -1]) == NONFINITE

    acc = EventAccumulator(tb_logger.log_dir, size_guidance={"tensors": 0, "scalars": 0, "images": 0})
    acc.Reload()
    (text,) = acc.Tensors("layer_health_findings/text_summary")
    assert text.step == NAN_STEP
    assert f"| {NAN_STEP} | nonfinite | {SICK} |" in text.tensor_proto.string_val[0].decode()
    assert [e.step for e in acc.Scalars("layer_health_alerts/active")] == evaluated
    (tb_image,) = acc.Images(f"layer_health_heatmap/{STAT}")
    pil = pytest.importorskip("PIL.Image")
    with pil.open(io.BytesIO(tb_image.encoded_image_string)) as decoded:
        assert (np.asarray(decoded.convert("RGB")) == image).all()

    # The report still reads the statistics: the alert count's key is outside the statistics' prefix.
    log = read_health_log(csv_logger.log_dir)
    assert log.prefix == "layer_health"
