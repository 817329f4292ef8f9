"""Findings, trips, the alert count and images written into real Lightning loggers, read back with each logger's reader.

Every test writes the same history (step 3: a trip and two findings, 3 alerts active; step 4: nothing new, 3 active;
step 5: one finding, 1 active) and then reads what a user would see: the CSV files, TensorBoard's
``EventAccumulator``, ``MlflowClient`` on a file store, and the files of an offline W&B run.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import RecordingLogger, finish_wandb, offline_wandb_logger
from helpers.offline_wandb import read_wandb_records
from helpers.png import decode_png
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_hookdiag._heatmap_image import render
from lightning_hookdiag._publish import FindingsWriter, trip_message, write_image
from lightning_hookdiag._step_state import Trip
from lightning_hookdiag.report import ReportError, ReportWarning
from lightning_hookdiag.report._findings_file import format_findings, read_findings
from lightning_hookdiag.rules._findings import Finding

DEAD = Finding("dead_units", "net.0", 3, 0.97, 0.9, "net.0: 97% of units | never fire", "forward", "act_dead_frac")
EXPLODING = Finding("exploding_gradient", "net.2", 3, math.inf, 1e3, "net.2: gradient norm inf", "backward", "grad")
VANISHING = Finding("vanishing_gradient", "net.4", 5, 1e-9, 1e-7, "net.4: gradient 1e-09", "backward", "grad")
TRIP = Trip(3, "nonfinite_loss", math.nan, last_finite_step=2, replayed=True, nan_entry="net.2", nan_origin="net.1")
TRIP_TEXT = (
    "sentinel tripped at step 3: the loss went non-finite (last finite at step 2); the NaN/Inf was made by net.1,"
    " first seen entering net.2; replayed with hooks"
)
# What a reader gets back, field by field, written out here rather than built with the module's own functions.
RECORDS = [
    {
        "kind": "trip",
        "rule": "nonfinite_loss",
        "step": 3,
        "loss": math.nan,
        "baseline": None,
        "last_finite_step": 2,
        "replayed": True,
        "reason": "",
        "nan_entry": "net.2",
        "nan_origin": "net.1",
        "bad_batch": [],
        "message": TRIP_TEXT,
    },
    {
        "kind": "finding",
        "rule": "dead_units",
        "layer": "net.0",
        "step": 3,
        "value": 0.97,
        "threshold": 0.9,
        "message": "net.0: 97% of units | never fire",
        "phase": "forward",
        "stat": "act_dead_frac",
    },
    {
        "kind": "finding",
        "rule": "exploding_gradient",
        "layer": "net.2",
        "step": 3,
        "value": math.inf,
        "threshold": 1e3,
        "message": "net.2: gradient norm inf",
        "phase": "backward",
        "stat": "grad",
    },
    {
        "kind": "finding",
        "rule": "vanishing_gradient",
        "layer": "net.4",
        "step": 5,
        "value": 1e-9,
        "threshold": 1e-7,
        "message": "net.4: gradient 1e-09",
        "phase": "backward",
        "stat": "grad",
    },
]
# The table rows (TensorBoard's Markdown, W&B's table): step, rule, layer, phase, value, threshold, message.
ROWS = [
    [3, "nonfinite_loss", "net.1", "", math.nan, None, TRIP_TEXT],
    [3, "dead_units", "net.0", "forward", 0.97, 0.9, "net.0: 97% of units | never fire"],
    [3, "exploding_gradient", "net.2", "backward", math.inf, 1000.0, "net.2: gradient norm inf"],
    [5, "vanishing_gradient", "net.4", "backward", 1e-9, 1e-7, "net.4: gradient 1e-09"],
]
ACTIVE = {3: 3.0, 4: 3.0, 5: 1.0}
COUNT_KEY = "layer_health/alerts_active"
IMAGE = render([[1.0, 10.0, None], [0.0, 100.0, math.nan]], cell=4)


def write_history(loggers: list[Any], writer: FindingsWriter | None = None) -> list[BaseException]:
    writer = writer or FindingsWriter()
    errors = writer.write(loggers, 3, [DEAD, EXPLODING], [TRIP], active=3)
    errors += writer.write(loggers, 4, [], [], active=3)
    errors += writer.write(loggers, 5, [VANISHING], [], active=1)
    errors += write_image(loggers, "layer_health_heatmap/act_std", IMAGE, 5)
    return errors


def read_png(path: Path) -> np.ndarray:
    """A PNG file's RGB pixels, read with Pillow (MLflow and W&B write PNGs with PIL, with filters of every type)."""
    pil = pytest.importorskip("PIL.Image")
    with pil.open(path) as image:
        return np.asarray(image.convert("RGB"))


def same(a: Any, b: Any) -> bool:
    """Equal, NaN included (JSON keeps NaN as a token that compares unequal to itself)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


HEADING = re.compile(r"^\*\*step (?P<step>\S+) · (?P<rule>[^·*]+?)(?: · (?P<layer>[^*]+))?\*\* \((?P<details>.*)\)$")


def markdown_rows(text: str) -> list[list[str]]:
    """``[step, rule, layer, phase, value, threshold, message]`` of each block of the findings text: a bold heading
    line ``**step k · rule · layer** (phase, value v, threshold t)``, a blank line, the message."""
    blocks = text.split("\n\n")
    assert len(blocks) % 2 == 0, text
    rows = []
    for heading, message in zip(blocks[::2], blocks[1::2], strict=True):
        match = HEADING.match(heading)
        assert match is not None, heading
        parts = match["details"].split(", ")
        phase = "" if parts[0].startswith("value ") else parts[0]
        value = next(p.removeprefix("value ") for p in parts if p.startswith("value "))
        threshold = next((p.removeprefix("threshold ") for p in parts if p.startswith("threshold ")), "")
        rows.append([match["step"], match["rule"], match["layer"] or "", phase, value, threshold, message])
    return rows


# ------------------------------------------------------------------------------------------------------------ CSV
def test_csv_logger_gets_the_findings_file_the_count_and_a_png(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="csv")
    assert write_history([logger]) == []
    logger.finalize("success")
    folder = Path(logger.log_dir)

    with open(folder / "findings.jsonl", encoding="utf-8") as f:
        assert same([json.loads(line) for line in f], RECORDS)
    assert same(read_findings(folder), RECORDS)
    with open(folder / "metrics.csv", newline="") as f:
        counts = {int(r["step"]): float(r[COUNT_KEY]) for r in csv.DictReader(f) if r[COUNT_KEY]}
    assert counts == ACTIVE
    png = folder / "layer_health_heatmap_act_std_step000005.png"
    assert (decode_png(png.read_bytes()) == IMAGE).all()


def test_csv_logger_folder_is_not_reported_as_holding_old_files(tmp_path: Path) -> None:
    # CSVLogger warns when its folder already holds files as it starts; the count is logged before the file is made.
    logger = CSVLogger(tmp_path, name="csv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert write_history([logger]) == []


# ---------------------------------------------------------------------------------------------------- TensorBoard
def test_tensorboard_shows_the_findings_as_text_the_count_as_a_scalar_and_the_heatmap(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    assert write_history([logger]) == []
    logger.finalize("success")

    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0, "images": 0})
    acc.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("layer_health_findings/text_summary")}
    assert sorted(texts) == [3, 5]  # nothing new at step 4: no text
    shown = [[str(r[0]), r[1], r[2], r[3], "nan", "", r[6]] for r in ROWS[:1]]
    shown += [["3", "dead_units", "net.0", "forward", "0.97", "0.9", ROWS[1][6]]]
    shown += [["3", "exploding_gradient", "net.2", "backward", "inf", "1000", ROWS[2][6]]]
    assert markdown_rows(texts[3]) == shown
    assert markdown_rows(texts[5]) == [["5", "vanishing_gradient", "net.4", "backward", "1e-09", "1e-07", ROWS[3][6]]]
    assert {e.step: e.value for e in acc.Scalars(COUNT_KEY)} == ACTIVE
    (image,) = acc.Images("layer_health_heatmap/act_std")
    assert (image.step, image.height, image.width) == (5, *IMAGE.shape[:2])
    pil = pytest.importorskip("PIL.Image")
    with pil.open(io.BytesIO(image.encoded_image_string)) as decoded:
        assert (np.asarray(decoded.convert("RGB")) == IMAGE).all()
    # The findings file beside the event files, for the report command.
    assert same(read_findings(logger.log_dir), RECORDS)


def test_tensorboard_logger_prefix_applies_as_to_its_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb", prefix="run1", default_hp_metric=False)
    assert write_history([logger]) == []
    logger.finalize("success")
    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    assert tags["scalars"] == [f"run1-{COUNT_KEY}"]
    assert tags["tensors"] == ["run1-layer_health_findings/text_summary"]
    assert tags["images"] == ["run1-layer_health_heatmap/act_std"]


# --------------------------------------------------------------------------------------------------------- MLflow
@pytest.fixture
def mlflow_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pytest.importorskip("mlflow")
    # MLflow >= 3.7 refuses a file store unless this is set (a database store needs SQLAlchemy, not in mlflow-skinny).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    return (tmp_path / "mlruns").as_uri()


def mlflow_findings(client: Any, run_id: str, tmp_path: Path) -> list[dict[str, Any]]:
    local = client.download_artifacts(run_id, "layer_health/findings.jsonl", str(tmp_path))
    return [json.loads(line) for line in Path(local).read_text(encoding="utf-8").splitlines()]


def test_mlflow_gets_a_tag_per_finding_the_findings_artifact_the_count_and_the_image(
    mlflow_uri: str, tmp_path: Path
) -> None:
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    logger = MLFlowLogger(experiment_name="hookdiag", tracking_uri=mlflow_uri)
    assert write_history([logger]) == []
    client = MlflowClient(tracking_uri=mlflow_uri)
    tags = {k: v for k, v in client.get_run(logger.run_id).data.tags.items() if k.startswith("layer_health")}
    assert tags == {
        "layer_health.finding.0000": f"step 3: {TRIP_TEXT}",
        "layer_health.finding.0001": "step 3: net.0: 97% of units | never fire",
        "layer_health.finding.0002": "step 3: net.2: gradient norm inf",
        "layer_health.finding.0003": "step 5: net.4: gradient 1e-09",
    }
    assert same(mlflow_findings(client, logger.run_id, tmp_path / "dl"), RECORDS)
    assert {m.step: m.value for m in client.get_metric_history(logger.run_id, COUNT_KEY)} == ACTIVE
    (png,) = [a.path for a in client.list_artifacts(logger.run_id, "images") if a.path.endswith(".png")]
    assert "step+5" in png  # MLflow's step-indexed image (shown with a step slider)
    local = client.download_artifacts(logger.run_id, png, str(tmp_path / "img"))
    assert (read_png(Path(local)) == IMAGE).all()


def test_mlflow_run_resumed_by_id_keeps_its_earlier_findings(mlflow_uri: str, tmp_path: Path) -> None:
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    first = MLFlowLogger(experiment_name="hookdiag", tracking_uri=mlflow_uri)
    assert FindingsWriter().write([first], 3, [DEAD, EXPLODING], [TRIP], active=3) == []
    # A new fit (a new writer) logging into the same run, as MLFlowLogger(run_id=...) does after a restart.
    resumed = MLFlowLogger(experiment_name="hookdiag", tracking_uri=mlflow_uri, run_id=first.run_id)
    assert FindingsWriter().write([resumed], 5, [VANISHING], [], active=1) == []
    client = MlflowClient(tracking_uri=mlflow_uri)
    assert same(mlflow_findings(client, first.run_id, tmp_path / "dl"), RECORDS)
    tags = client.get_run(first.run_id).data.tags
    assert tags["layer_health.finding.0003"] == "step 5: net.4: gradient 1e-09"


def test_mlflow_without_pil_gets_the_heatmap_as_a_png_artifact(
    mlflow_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    logger = MLFlowLogger(experiment_name="hookdiag", tracking_uri=mlflow_uri)
    _ = logger.experiment  # the run is made before PIL goes away
    monkeypatch.setitem(sys.modules, "PIL", None)  # `import PIL.Image` now raises ImportError
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    assert write_image([logger], "layer_health_heatmap/act_std", IMAGE, 5) == []
    client = MlflowClient(tracking_uri=mlflow_uri)
    names = [a.path for a in client.list_artifacts(logger.run_id, "images")]
    assert names == ["images/layer_health_heatmap_act_std_step000005.png"]
    local = client.download_artifacts(logger.run_id, names[0], str(tmp_path / "img"))
    assert (decode_png(Path(local).read_bytes()) == IMAGE).all()


# ------------------------------------------------------------------------------------------------------------ W&B
def test_wandb_gets_a_table_of_the_runs_findings_with_the_count_and_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("PIL")
    logger = offline_wandb_logger(tmp_path, monkeypatch)
    from wandb.proto import wandb_internal_pb2

    try:
        assert write_history([logger]) == []
    finally:
        finish_wandb()

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    files = run_file.parent / "files"
    history = []
    for raw in read_wandb_records(run_file):
        record = wandb_internal_pb2.Record.FromString(raw)
        if record.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:  # a media value is stored as one item per field: nested_key [key, field]
                *outer, last = [item.key] if item.key else list(item.nested_key)
                place = row
                for key in outer:
                    place = place.setdefault(key, {})
                place[last] = json.loads(item.value_json)
            history.append(row)
    counts = {row["trainer/global_step"]: row[COUNT_KEY] for row in history if COUNT_KEY in row}
    assert counts == ACTIVE
    tables = {
        row["trainer/global_step"]: row["layer_health_findings"] for row in history if "layer_health_findings" in row
    }
    assert sorted(tables) == [3, 5]
    for step, rows in ((3, ROWS[:3]), (5, ROWS)):  # each table holds the run's findings so far
        assert tables[step]["_type"] == "table-file"
        stored = json.loads((files / tables[step]["path"]).read_text())
        assert stored["columns"] == ["step", "rule", "layer", "phase", "value", "threshold", "message"]
        assert same(stored["data"], rows)
    (images,) = [row["layer_health_heatmap/act_std"] for row in history if "layer_health_heatmap/act_std" in row]
    assert (images["count"], images["width"], images["height"]) == (1, IMAGE.shape[1], IMAGE.shape[0])
    (png,) = images["filenames"]
    assert (read_png(files / png) == IMAGE).all()


# ------------------------------------------------------------------------------------------- every logger at once
class Failing(RecordingLogger):
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        raise OSError("disk full")


def test_a_failing_logger_does_not_keep_the_others_from_the_step(tmp_path: Path) -> None:
    csv_logger, plain = CSVLogger(tmp_path, name="csv"), RecordingLogger()
    errors = FindingsWriter().write([Failing(), csv_logger, plain], 3, [DEAD], [], active=1)
    assert [str(e) for e in errors] == ["disk full"]
    assert same(read_findings(csv_logger.log_dir), [RECORDS[1]])
    assert plain.calls == [(3, {COUNT_KEY: 1.0})]  # a logger with nowhere to put text still gets the count


def test_the_prefix_names_the_count(tmp_path: Path) -> None:
    plain = RecordingLogger()
    FindingsWriter(prefix="enc_health").write([plain], 0, [], [], active=0)
    assert plain.calls == [(0, {"enc_health/alerts_active": 0.0})]


def test_only_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logger = CSVLogger(tmp_path, name="csv")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert write_history([logger]) == []
    assert not (tmp_path / "csv").exists()


@pytest.mark.parametrize(
    ("image", "match"),
    [
        (np.zeros((4, 4), dtype=np.uint8), r"got shape \(4, 4\) and dtype uint8"),
        (np.zeros((4, 4, 3), dtype=np.float64), r"got shape \(4, 4, 3\) and dtype float64"),
    ],
)
def test_an_image_that_is_not_rgb_uint8_is_refused_before_any_logger(tmp_path: Path, image: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        write_image([CSVLogger(tmp_path)], "t", image, 0)
    assert not list(tmp_path.rglob("*.png"))


def test_a_torch_image_is_written_as_its_pixels(tmp_path: Path) -> None:
    import torch

    logger = CSVLogger(tmp_path, name="csv")
    assert write_image([logger], "heat", torch.from_numpy(IMAGE), 2) == []
    assert (decode_png((Path(logger.log_dir) / "heat_step000002.png").read_bytes()) == IMAGE).all()


def test_trip_messages_say_what_was_seen_and_whether_it_was_replayed() -> None:
    spike = Trip(7, "loss_spike", 12.5, baseline=1.25, reason="manual optimization")
    assert trip_message(spike) == (
        "sentinel tripped at step 7: the loss spiked to 12.5 (baseline 1.25); not replayed: manual optimization"
    )
    grads = Trip(9, "nonfinite_grad", 0.5, last_finite_step=8, replayed=True, bad_batch=(("batch[0]", 3, 32),))
    assert trip_message(grads) == (
        "sentinel tripped at step 9: the loss or a gradient went non-finite (last finite at step 8);"
        " the batch holds NaN/Inf: batch[0] (3 of 32); replayed with hooks"
    )


# ------------------------------------------------------------------------------------------ the file read back
def test_reading_a_run_without_findings_gives_none_and_a_missing_folder_an_error(tmp_path: Path) -> None:
    assert read_findings(tmp_path) == []
    with pytest.raises(ReportError, match="no such file or folder"):
        read_findings(tmp_path / "absent")


def test_a_last_line_cut_short_is_left_out_with_a_warning_and_a_bad_line_before_it_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "findings.jsonl"
    path.write_text('{"kind": "finding", "step": 1, "rule": "r", "message": "m"}\n{"kind": "fi')
    with pytest.warns(ReportWarning, match=r"findings.jsonl:2: left out a line cut short"):
        assert read_findings(path) == [{"kind": "finding", "step": 1, "rule": "r", "message": "m"}]
    path.write_text('{"kind": "fi\n{"kind": "finding", "step": 1}\n')
    with pytest.raises(ReportError, match=r"findings.jsonl:1: not a JSON line"):
        read_findings(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ReportError, match=r"findings.jsonl:1: expected a JSON object with a 'kind', got '\[1, 2\]'"):
        read_findings(tmp_path)


def test_findings_are_printed_one_a_line_steps_aligned() -> None:
    records = [{"step": 3, "rule": "dead_units", "message": "a"}, {"step": 12, "rule": "nonfinite", "message": "b"}]
    assert format_findings(records) == "step  3  dead_units  a\nstep 12  nonfinite  b"
    assert format_findings([]) == ""
