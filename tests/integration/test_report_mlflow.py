"""``hookdiag report mlflow:<run id>``: a real fit logged by ``MLFlowLogger`` (a file store), read back by the report.

The same fit logs to CSV beside it: the two readers must agree on every value, and ``--diff`` across them finds no
difference. The summary and the findings are read from the MLflow run itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TinyModule, make_trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.report import build_health_log, read_health_log
from lightning_hookdiag.report._cli import main as report_main
from lightning_hookdiag.report._mlflow_run import read_mlflow_scalars

pytest.importorskip("mlflow")


def dead_relu_module() -> TinyModule:
    """A ReLU after a Linear whose bias is -10: a finding for the report to print."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
    module = TinyModule(model=model)
    module.record_enabled = False
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    from lightning.pytorch.loggers import MLFlowLogger

    tmp = tmp_path_factory.mktemp("mlflow_run")
    uri = f"file:{tmp / 'mlruns'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3.7+ refuses a file store without it
        mlflow_logger = MLFlowLogger(experiment_name="report", tracking_uri=uri)
        csv_logger = CSVLogger(tmp, name="csv")
        callback = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False})
        make_trainer([callback], max_steps=5, logger=[mlflow_logger, csv_logger]).fit(dead_relu_module())
    assert [f.rule for f in callback.findings] == ["dead_units"]
    return uri, f"mlflow:{mlflow_logger.run_id}", Path(csv_logger.log_dir)


def test_the_report_of_an_mlflow_run_prints_its_summary_and_findings(run, tmp_path, capsys):
    uri, source, _ = run
    out = tmp_path / "heat.png"
    status = report_main(["report", source, "--tracking-uri", uri, "--stat", "act_dead_frac", "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert printed.out.rstrip().endswith(f"heatmap: {out}")
    # The run's finding, read back from its findings artifact.
    assert "findings and sentinel trips (1, from findings.jsonl)" in printed.out
    assert "dead_units: 100.0% of the units of model.1" in printed.out


def test_the_mlflow_run_and_the_csv_log_of_one_fit_hold_the_same_values(run, capsys):
    uri, source, csv_dir = run
    from_mlflow = build_health_log(read_mlflow_scalars(source, uri))
    from_csv = read_health_log(csv_dir)
    assert from_mlflow.steps == from_csv.steps == (0, 2, 4)
    assert from_mlflow.stats.keys() == from_csv.stats.keys()
    for stat, layers in from_csv.stats.items():
        assert from_mlflow.stats[stat].keys() == layers.keys()
        for layer, by_step in layers.items():
            assert from_mlflow.stats[stat][layer] == pytest.approx(by_step, rel=1e-12, nan_ok=True), (stat, layer)
    assert report_main(["report", "--diff", source, str(csv_dir), "--tracking-uri", uri]) == 0
    assert f"RUN_A: {source}" in capsys.readouterr().out


def test_an_unknown_mlflow_run_is_one_error_line(run, capsys):
    uri, _, _ = run
    assert report_main(["report", "mlflow:0123456789abcdef", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hookdiag: error: MLflow run '0123456789abcdef' not found")
    assert err.count("\n") == 1
