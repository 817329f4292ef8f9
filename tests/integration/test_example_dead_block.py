"""``examples/sick_dead_block.py``: the 48-layer dead block is named at its origin on the first sampled step, in the
callback and in the log folder; its healthy twin logs the same statistics and is silent.

The dead layer is derived from the model's structure (the ReLU right after the Linear whose bias is far below zero)
and from the logged ``act_dead_frac`` values, never from what the rules say.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from helpers import csv_statistic
from helpers.keys import parse_key
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning

pytestmark = pytest.mark.slow  # two 100-step fits of a 97-layer model, ~10-20 s each on 2 busy cores

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PREFIX = "layer_health"


def example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def fit(ex: ModuleType, log_dir: Path, *extra: str) -> tuple[LayerHealthCallback, list[str]]:
    """Run the example's ``main``; return its callback and the messages of the LayerHealthWarnings it emitted."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        callback = ex.main(["--log-dir", str(log_dir), *extra])
    return callback, [str(w.message) for w in record if issubclass(w.category, LayerHealthWarning)]


def csv_dir(log_dir: Path, name: str) -> Path:
    (found,) = (log_dir / name).glob("version_*")
    return found


def logged(run: Path, stat: str) -> dict[int, dict[str, float]]:
    """``{step: {layer: value}}`` of one statistic, read back from ``metrics.csv``."""
    return csv_statistic(run, stat, PREFIX)


def statistic_keys(run: Path) -> set[str]:
    with open(run / "metrics.csv", newline="") as fh:
        header = next(csv.reader(fh))
    return {key for key in header if parse_key(key, PREFIX) is not None}


def findings_file(run: Path) -> list[dict[str, object]]:
    """The rows of ``findings.jsonl`` beside ``metrics.csv`` (none when the file was not written)."""
    path = run / "findings.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def structure(ex: ModuleType) -> tuple[list[str], list[str], str, str]:
    """Layer names in ``net``'s order, its ReLUs, the Linear with the far-negative bias and the ReLU right after it."""
    net = ex.build_model().net
    names = [f"net.{n}" for n, _ in net.named_children()]
    relus = [f"net.{n}" for n, m in net.named_children() if isinstance(m, nn.ReLU)]
    (broken,) = [
        f"net.{n}" for n, m in net.named_children() if isinstance(m, nn.Linear) and float(m.bias.detach().max()) < -5
    ]
    return names, relus, broken, names[names.index(broken) + 1]


@dataclass
class Fit:
    log_dir: Path
    callback: LayerHealthCallback
    warned: list[str]  # the messages of the LayerHealthWarnings emitted during the fit


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Fit]:
    """The example run once sick and once ``--healthy``, each into its own log folder."""
    ex = example("sick_dead_block")
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        # The example sets this for mlflow's file store; it is removed again when the block ends.
        patch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        for kind, extra in (("sick", []), ("healthy", ["--healthy"])):
            log_dir = tmp_path_factory.mktemp(kind)
            callback, warned = fit(ex, log_dir, *extra)
            out[kind] = Fit(log_dir, callback, warned)
    return out


def test_dead_block_is_named_at_its_origin_on_the_first_sampled_step(fits):
    ex = example("sick_dead_block")
    names, relus, broken, dead = structure(ex)
    assert len(relus) == 48  # 48 Linear + ReLU blocks and a head
    assert names[-1] == "net.96"
    assert (broken, dead) == ("net.60", "net.61")  # what the example's docstring and the README say
    assert dead in relus

    tmp_path, callback, warned = fits["sick"].log_dir, fits["sick"].callback, fits["sick"].warned
    run = csv_dir(tmp_path, ex.NAME)
    assert callback.execution_order == names

    # From the logged values: every ReLU from the dead one on is dead on every sampled step, none before it is.
    dead_frac = logged(run, "act_dead_frac")
    steps = sorted(dead_frac)
    assert steps == list(range(0, ex.MAX_STEPS, ex.EVERY_N_STEPS))
    after = relus[relus.index(dead) :]
    before = relus[: relus.index(dead)]
    for step in steps:
        assert set(dead_frac[step]) == set(relus)
        assert all(dead_frac[step][r] == 1.0 for r in after), step
        assert all(dead_frac[step][r] < 0.5 for r in before), step
    # ... and nothing below the broken Linear gets any gradient (the block also stops the backward pass).
    grad = logged(run, "act_grad_norm")
    for step in steps:
        assert all(grad[step][n] == 0.0 for n in names[: names.index(dead)]), step
        assert grad[step][names[-1]] > 0.0

    # The callback names the origin (the dead ReLU or its Linear) on the first sampled step, and no finding points
    # above it: every layer named is the origin or downstream of it.
    origin = {broken, dead}
    first = steps[0]
    assert any(f.step == first and f.layer in origin for f in callback.findings)
    assert all(names.index(f.layer) >= names.index(broken) for f in callback.findings)
    assert warned == [f"LayerHealthCallback: {f.message}" for f in callback.findings]

    # The same findings in findings.jsonl beside metrics.csv, and in the TensorBoard run's folder.
    rows = [r for r in findings_file(run) if r["kind"] == "finding"]
    assert [(r["rule"], r["layer"], r["step"]) for r in rows] == [(f.rule, f.layer, f.step) for f in callback.findings]
    assert any(r["step"] == first and r["layer"] in origin for r in rows)
    assert findings_file(csv_dir(tmp_path, f"{ex.NAME}_tb")) == findings_file(run)

    # MLflow (when installed): the file store under the log folder holds the run, with the origin in a finding tag.
    if importlib.util.find_spec("mlflow") is not None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
        experiment = client.get_experiment_by_name(ex.NAME)
        assert experiment is not None
        (mlflow_run,) = client.search_runs([experiment.experiment_id])
        tags = [v for k, v in mlflow_run.data.tags.items() if ".finding." in k]
        assert len(tags) == len(callback.findings)
        assert any(f"step {first}:" in v and dead in v for v in tags), tags


def test_healthy_twin_logs_the_same_statistics_and_finds_nothing(fits):
    ex = example("sick_dead_block")
    net = ex.build_model(healthy=True).net
    assert all(float(m.bias.detach().abs().max()) == 0.0 for m in net if isinstance(m, nn.Linear))

    sick, healthy, warned = fits["sick"].callback, fits["healthy"].callback, fits["healthy"].warned
    sick_run = csv_dir(fits["sick"].log_dir, ex.NAME)
    healthy_run = csv_dir(fits["healthy"].log_dir, ex.HEALTHY_NAME)

    assert healthy.findings == []
    assert healthy.last_findings == []
    assert warned == []
    assert not [r for r in findings_file(healthy_run) if r["kind"] == "finding"]
    # The same charts: every statistic of every layer, on the same sampled steps; the sick run lacks only the update
    # ratios left out because they are undefined there (biases that stay exactly 0 behind the dead block, 0 / 0).
    missing = statistic_keys(healthy_run) - statistic_keys(sick_run)
    assert statistic_keys(sick_run) <= statistic_keys(healthy_run)
    frozen = {name for by_layer in logged(sick_run, "param_norm").values() for name, v in by_layer.items() if v == 0}
    assert missing
    assert {parse_key(key, PREFIX).name for key in missing} <= frozen
    assert {parse_key(key, PREFIX).stat for key in missing} == {"param_update_ratio"}
    assert sorted(logged(healthy_run, "act_std")) == sorted(logged(sick_run, "act_std"))
    assert healthy.execution_order == sick.execution_order
    # From the values: every ReLU has live units on every sampled step, and the gradient reaches the input end.
    for step, by_layer in logged(healthy_run, "act_dead_frac").items():
        assert max(by_layer.values()) < 1.0, step
    for step, by_layer in logged(healthy_run, "act_grad_norm").items():
        assert by_layer[healthy.execution_order[0]] > 0.0, step
