"""Lightning conventions in the callback: ``@override`` on hooks, ``isinstance`` for strategies and loggers, and
histograms keyed through the logger, so that a logger's ``prefix`` applies to them as it does to scalars."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from helpers import RecordingLogger, TinyModule, make_data, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from lightning_hookdiag import LayerHealthCallback


def test_every_hook_is_marked_override():
    hooks = [name for name in vars(LayerHealthCallback) if name in vars(Callback) and not name.startswith("__")]
    assert {"on_fit_start", "on_train_batch_start", "on_train_batch_end", "teardown", "state_dict"} <= set(hooks)
    for name in hooks:
        member = vars(LayerHealthCallback)[name]
        function = member.fget if isinstance(member, property) else member
        assert getattr(function, "__override__", False), name


class _Run:
    def __init__(self) -> None:
        self.logged: list[dict[str, Any]] = []

    def log(self, row: dict[str, Any]) -> None:
        self.logged.append(row)


class OfflineWandb(WandbLogger):
    """A WandbLogger whose run records rows in memory (no W&B process), to read back what the callback wrote."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run = _Run()

    @property
    def experiment(self) -> Any:  # type: ignore[override]
        return self.run


def test_wandb_histograms_go_through_log_metrics_with_the_logger_prefix(tmp_path):
    wandb = pytest.importorskip("wandb")
    logger = OfflineWandb(prefix="exp", save_dir=str(tmp_path), offline=True)
    callback = LayerHealthCallback(
        every_n_steps=2, measure={"histogram_every_n_steps": 2, "histogram_bins": 8}, output={"summary": False}
    )
    make_trainer([callback], max_steps=1, logger=[logger]).fit(TinyModule(data=make_data(n=16)))
    histograms = [row for row in logger.run.logged if any(isinstance(v, wandb.Histogram) for v in row.values())]
    assert histograms, "no histogram reached the W&B run"
    for row in histograms:  # one per series, each with the step W&B plots it at
        (tag,) = [key for key in row if key != "trainer/global_step"]
        assert re.fullmatch(r"exp-layer_health\.act(_grad)?_hist/\d_model\.\d", tag), tag
        assert row["trainer/global_step"] == 0
    assert len(histograms) == 2 * 3  # outputs and their gradients, of the 3 layers
    # Scalars get the same prefix from the same logger.
    scalars = [key for row in logger.run.logged for key in row if "act_mean" in key]
    assert scalars
    assert all(key.startswith("exp-layer_health") for key in scalars)


def test_a_class_named_wandblogger_is_not_a_wandb_logger(caplog):
    impostor = type("WandbLogger", (RecordingLogger,), {})()
    callback = LayerHealthCallback(
        every_n_steps=2, measure={"histogram_every_n_steps": 2, "histogram_bins": 8}, output={"summary": False}
    )
    with caplog.at_level(logging.INFO):
        make_trainer([callback], max_steps=1, logger=[impostor]).fit(TinyModule(data=make_data(n=16)))
    # The name-based check handed it to W&B code: a histogram would have reached it through log_metrics.
    assert not [key for _, metrics in impostor.raw for key in metrics if "_hist" in key]
    assert sum("WandbLogger cannot store histograms" in r.message for r in caplog.records) == 1


def test_tensorboard_histograms_carry_the_logger_prefix_like_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(tmp_path, name="tb", prefix="exp")
    callback = LayerHealthCallback(
        every_n_steps=2, measure={"histogram_every_n_steps": 2, "histogram_bins": 8}, output={"summary": False}
    )
    make_trainer([callback], max_steps=1, logger=[tb]).fit(TinyModule(data=make_data(n=16)))
    accumulator = EventAccumulator(tb.log_dir, size_guidance={"histograms": 0, "scalars": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    assert "exp-layer_health.act_mean/1_model.1" in tags["scalars"]
    assert "exp-layer_health/act_std_min" in tags["scalars"]  # the summary group
    assert "exp-layer_health.act_hist/1_model.1" in tags["histograms"]
    assert "exp-layer_health.act_grad_hist/1_model.1" in tags["histograms"]
    assert not [t for t in tags["histograms"] if not t.startswith("exp-")]
