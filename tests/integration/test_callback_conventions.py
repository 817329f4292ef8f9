"""Lightning conventions in the callback: ``@override`` on hooks, ``isinstance`` for strategies and loggers, and
histograms keyed through the logger, so that a logger's ``prefix`` applies to them as it does to scalars."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from conftest import RecordingLogger, TinyModule, make_data, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.callback import _histogram_writer
from lightning_hookdiag.replay import sharded


def test_every_hook_is_marked_override():
    hooks = [name for name in vars(LayerHealthCallback) if name in vars(Callback) and not name.startswith("__")]
    assert {"on_fit_start", "on_train_batch_start", "on_train_batch_end", "teardown", "state_dict"} <= set(hooks)
    for name in hooks:
        member = vars(LayerHealthCallback)[name]
        function = member.fget if isinstance(member, property) else member
        assert getattr(function, "__override__", False), name


class FSDPStrategy2(FSDPStrategy):
    """A user's subclass: shards just the same."""


def test_sharded_strategies_are_recognised_by_class_not_by_name():
    def trainer(strategy: Any) -> Any:
        return SimpleNamespace(strategy=strategy)

    assert sharded(trainer(ModelParallelStrategy()), {})
    assert sharded(trainer(FSDPStrategy2()), {})
    assert not sharded(trainer(DDPStrategy()), {})
    assert not sharded(trainer(SingleDeviceStrategy("cpu")), {})
    # A class that merely has the name is not one (the name-based check said it was).
    impostor = type("FSDPStrategy", (), {})()
    assert not sharded(trainer(impostor), {})


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
    pytest.importorskip("wandb")
    logger = OfflineWandb(prefix="exp", save_dir=str(tmp_path), offline=True)
    write = _histogram_writer(logger)
    assert write is not None
    write("layer_health/act_hist/model.1", [1.0, 2.0], [-1.0, 0.0], [0.0, 1.0], 4)
    (row,) = logger.run.logged
    assert sorted(row) == ["exp-layer_health/act_hist/model.1", "trainer/global_step"]
    assert row["trainer/global_step"] == 4
    # Scalars get the same prefix from the same logger.
    logger.log_metrics({"layer_health/act_mean/model.1": 0.5}, step=4)
    assert "exp-layer_health/act_mean/model.1" in logger.run.logged[-1]


def test_a_class_named_wandblogger_is_not_a_wandb_logger():
    impostor = type("WandbLogger", (RecordingLogger,), {})()
    assert _histogram_writer(impostor) is None  # the name-based check handed it to W&B code


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
