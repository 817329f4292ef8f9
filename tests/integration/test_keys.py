"""The logged keys as each logger's own reader shows them: one group per statistic, layers in forward order.

A deep ReLU stack with zero-initialised biases and one bias at -10 (every layer after it is dead, and no gradient
reaches the layers before it, so their zero biases stay zero: an update ratio of 0/0), fitted once with TensorBoard,
MLflow and CSV loggers together; the keys are read back with EventAccumulator, MlflowClient and the csv module.
"""

from __future__ import annotations

import csv
import math
import os
from collections import defaultdict

import pytest
import torch
from helpers import RecordingLogger, TinyModule, make_data, make_trainer
from torch import nn

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._keys import ALERTS_ACTIVE
from lightning_hookdiag._vocabulary import SUMMARIES
from lightning_hookdiag.report import read_health_log

ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
mlflow_tracking = pytest.importorskip("mlflow.tracking")
loggers = pytest.importorskip("lightning.pytorch.loggers")

P = "layer_health"
BLOCKS = 6  # 13 layers: depths 0..12, two digits, and net.10 sorts after net.9 only with them


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(BLOCKS):
            layers += [nn.Linear(4, 4), nn.ReLU()]
        layers.append(nn.Linear(4, 1))
        self.net = nn.Sequential(*layers)
        with torch.no_grad():
            for m in self.net:
                if isinstance(m, nn.Linear):
                    m.bias.zero_()
            self.net[6].bias.fill_(-10.0)  # net.7 and every ReLU after it are dead
        self.scale = nn.Parameter(torch.ones(1))  # the container's own parameter: no selected layer owns it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def tb_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    acc = ea.EventAccumulator(log_dir, size_guidance={ea.SCALARS: 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    root = tmp_path_factory.mktemp("keys")
    tb = loggers.TensorBoardLogger(str(root), name="tb", version=0)
    ml = loggers.MLFlowLogger(experiment_name="keys", tracking_uri=f"file:{root / 'mlruns'}")
    csv_logger = loggers.CSVLogger(str(root), name="csv", version=0)
    callback = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False, "heatmap_stats": ()})
    module = TinyModule(Deep(), make_data(32, 4, 1), lr=0.05)
    make_trainer([callback], max_steps=6, logger=[tb, ml, csv_logger]).fit(module)
    run = mlflow_tracking.MlflowClient(tracking_uri=f"file:{root / 'mlruns'}").get_run(ml.run_id)
    client = mlflow_tracking.MlflowClient(tracking_uri=f"file:{root / 'mlruns'}")
    history = {k: [(m.step, m.value) for m in client.get_metric_history(ml.run_id, k)] for k in run.data.metrics}
    with open(os.path.join(csv_logger.log_dir, "metrics.csv"), newline="") as f:
        columns = next(csv.reader(f))
    return {
        "tb": tb_scalars(tb.log_dir),
        "tb_dir": tb.log_dir,
        "mlflow": history,
        "csv": columns,
        "order": list(callback.execution_order),
        "params": [name for name, _ in module.named_parameters()],
    }


def ours(keys: object) -> list[str]:
    return [k for k in keys if k.startswith(P + "/") or k.startswith(P + ".")]  # type: ignore[attr-defined]


def groups(keys: list[str]) -> dict[str, list[str]]:
    """TensorBoard's and W&B's grouping: the part of a tag before its first '/'."""
    out: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        out[key.partition("/")[0]].append(key.partition("/")[2])
    return out


def expected_param_order(order: list[str], params: list[str]) -> list[str]:
    """Parameters by their module's place in the forward order; a container's own (``model.scale``) at the place of
    the first layer inside it."""
    place = {name: i for i, name in enumerate(order)}

    def key(param: str) -> tuple[int, str]:
        module = param.rpartition(".")[0]
        inside = [i for name, i in place.items() if name.startswith(module + ".")]
        return (place.get(module, min(inside, default=len(order))), param)

    return sorted(params, key=key)


def test_tensorboard_has_one_group_per_statistic_and_a_one_page_summary(fitted: dict) -> None:
    by_group = groups(ours(fitted["tb"]))
    stats = {g.removeprefix(P + ".") for g in by_group if g != P}
    assert stats == {
        "act_mean", "act_std", "act_absmax", "act_zero_frac", "act_dead_frac", "act_grad_norm",
        "param_norm", "param_grad_norm", "param_update_ratio", "logit_lse_mean", "logit_absmax",
    } - {"logit_lse_mean"}  # fmt: skip  # a [N, 1] output has no log-sum-exp over classes to take
    summary = sorted(by_group[P])
    expected = ["grad_norm_total", ALERTS_ACTIVE, *(f"{s}_{k}" for s, kinds in SUMMARIES.items() for k in kinds)]
    assert summary == sorted(expected)
    assert len(summary) <= 12  # one page of TensorBoard's 12 cards
    # No constant metadata per step, and the healthy run's non-finite counts only in the summary (charts="default").
    assert not [t for t in fitted["tb"] if "depth" in t]
    assert "act_nonfinite" not in stats
    assert "act_grad_nonfinite" not in stats


def test_a_plain_sort_lists_layers_in_forward_order_in_every_logger(fitted: dict) -> None:
    order, params = fitted["order"], expected_param_order(fitted["order"], fitted["params"])
    assert order[:3] == ["model.net.0", "model.net.1", "model.net.2"]
    for source in ("tb", "mlflow", "csv"):
        for group, members in groups(ours(fitted[source])).items():
            if group == P:
                continue
            names = [m.partition("_")[2] for m in sorted(members)]
            wanted = params if group.startswith(P + ".param_") else order
            assert names == [n for n in wanted if n in names], (source, group)
    assert "00_model.scale" in groups(ours(fitted["tb"]))[P + ".param_norm"]  # its container starts at depth 0
    act_std = groups(ours(fitted["mlflow"]))[P + ".act_std"]
    assert {"09_model.net.9", "10_model.net.10"} <= set(act_std)  # the depth is the forward place, zero-padded


def test_mlflow_and_csv_hold_the_same_keys_as_tensorboard(fitted: dict) -> None:
    assert sorted(ours(fitted["mlflow"])) == sorted(ours(fitted["tb"]))
    assert sorted(ours(fitted["csv"])) == sorted(ours(fitted["tb"]))


def test_undefined_update_ratios_are_absent_not_nan(fitted: dict) -> None:
    logged = {m.partition("_")[2] for m in groups(ours(fitted["mlflow"]))[P + ".param_update_ratio"]}
    # No gradient reaches below the dead layer: the zero biases there stay 0 for the whole fit, 0/0 on each step.
    frozen_zero = {f"model.net.{i}.bias" for i in range(0, 6, 2)}
    assert not logged & frozen_zero
    assert "model.net.6.bias" in logged  # -10: defined
    assert "model.net.0.weight" in logged  # not moved (ratio 0), but defined
    for key, points in fitted["mlflow"].items():
        if key.startswith(P):
            assert all(not math.isnan(v) for _, v in points), key
    # The head's zero bias moves on step 0: its ratio is undefined on step 0 only.
    head = next(k for k in fitted["mlflow"] if k.endswith("_model.net.12.bias") and ".param_update_ratio/" in k)
    assert [s for s, _ in fitted["mlflow"][head]] == [2, 4]


def test_the_summary_is_the_worst_logged_layer_value(fitted: dict) -> None:
    scalars = fitted["tb"]
    for stat, kinds in SUMMARIES.items():
        per_layer = [pts for tag, pts in scalars.items() if tag.startswith(f"{P}.{stat}/")]
        for kind in kinds:
            summary = dict(scalars[f"{P}/{stat}_{kind}"])
            assert sorted(summary) == [0, 2, 4]
            for step, value in summary.items():
                at_step = [v for pts in per_layer for s, v in pts if s == step]
                if not at_step:  # the non-finite counts: not logged per layer while all are 0
                    assert value == 0.0, (stat, step)
                    continue
                assert value == pytest.approx(min(at_step) if kind == "min" else max(at_step), rel=1e-6), (stat, step)


def test_the_report_reads_the_depth_from_the_keys(fitted: dict) -> None:
    log = read_health_log(fitted["tb_dir"])
    assert log.layers("act_std") == list(fitted["order"])
    assert log.layers("param_norm") == expected_param_order(fitted["order"], fitted["params"])
    assert "act_grad_norm_min" in log.totals


def test_charts_all_logs_every_per_layer_count_and_a_nan_weight_is_still_nan() -> None:
    model = Deep()
    with torch.no_grad():
        model.net[0].weight[0, 0] = math.nan
    logger = RecordingLogger()
    callback = LayerHealthCallback(
        every_n_steps=1, on_anomaly="ignore", output={"summary": False, "charts": "all", "heatmap_stats": ()}
    )
    make_trainer([callback], max_steps=1, logger=logger).fit(TinyModule(model, make_data(32, 4, 1)))
    (step, metrics), *_ = [(s, m) for s, m in logger.raw if any(k.startswith(P) for k in m)]
    assert math.isnan(metrics[f"{P}.param_norm/00_model.net.0.weight"])
    assert math.isnan(metrics[f"{P}.param_update_ratio/00_model.net.0.weight"])  # NaN weights: NaN, not left out
    counts = [k for k in metrics if k.startswith(f"{P}.act_nonfinite/")]
    assert len(counts) == 2 * BLOCKS + 1  # every layer, also those with none
    assert metrics[f"{P}/act_nonfinite_max"] == max(metrics[k] for k in counts) > 0


def test_charts_is_checked() -> None:
    with pytest.raises(ValueError, match=r"charts.*'default'.*'all'"):
        LayerHealthCallback(output={"charts": "some"})  # type: ignore[arg-type]
