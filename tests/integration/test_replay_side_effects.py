"""What a replay of a tripped step leaves behind (issue 35, items 14-16): nothing, or a trip that says why.

Real fits: a loss spike planted on an unsampled step trips the sentinel, and the run is compared with the same run
without the callback.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import RecordingLogger, TinyModule, make_data, make_trainer
from torch import nn
from torch.utils.data import TensorDataset

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._inplace import REPLAY_SAVE_BYTES

SPIKE = 8
SENTINEL = {"warmup": 5}


def spiked(n_steps: int, d_in: int = 4, batch_size: int = 8) -> TensorDataset:
    """Regression data whose targets on optimizer step SPIKE are 1000x larger: a loss spike on an unsampled step."""
    data = make_data(n_steps * batch_size, d_in=d_in)
    x, y = data.tensors
    y[SPIKE * batch_size : (SPIKE + 1) * batch_size] *= 1e3
    return TensorDataset(x, y)


def fit(make: Callable[[], TinyModule], callback: LayerHealthCallback | None, steps: int, **kwargs: Any) -> TinyModule:
    """Build a module with ``make`` and fit it, from the same seed every time."""
    # Clipped: the spike's gradient does not throw the model off, so the steps after it do not trip as well.
    torch.manual_seed(0)
    module = make()
    trainer = make_trainer([] if callback is None else [callback], max_steps=steps, gradient_clip_val=0.5, **kwargs)
    trainer.fit(module)
    return module


def callback() -> LayerHealthCallback:
    return LayerHealthCallback(every_n_steps=100, on_anomaly="ignore", sentinel=SENTINEL, output={"summary": False})


# ------------------------------------------------------------------------------------------- in-place writes
class MeanTeacher(TinyModule):
    """A student trained towards a mean teacher that ``training_step`` updates in place (an EMA), under ``no_grad``.

    Also a plain tensor attribute updated in place (DINO's output centre) and one rebound every step (a count).
    """

    def __init__(self, model: nn.Module | None = None, data: TensorDataset | None = None, momentum: float = 0.9):
        super().__init__(model=model, data=data, lr=0.01)
        self.record_enabled = False
        self.teacher = copy.deepcopy(self.model).requires_grad_(False)
        self.momentum = momentum
        self.center = torch.zeros(1)
        self.updates = torch.zeros(())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        with torch.no_grad():
            target = self.teacher(x)
        loss = nn.functional.mse_loss(out, y) + 0.1 * nn.functional.mse_loss(out, target)
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.model.parameters(), strict=True):
                t.mul_(self.momentum).add_(s, alpha=1 - self.momentum)
            self.center.mul_(0.9).add_(out.mean(), alpha=0.1)
        self.updates = self.updates + 1
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)


def _assert_same_training(plain: MeanTeacher, watched: MeanTeacher) -> None:
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the student and the teacher
    assert torch.equal(plain.center, watched.center)
    assert torch.equal(plain.updates, watched.updates)
    assert int(watched.updates) == plain.trainer.global_step


def test_a_replayed_mean_teacher_step_updates_the_teacher_once():
    steps = SPIKE + 4
    plain = fit(lambda: MeanTeacher(data=spiked(steps)), None, steps)
    sentinel = callback()
    watched = fit(lambda: MeanTeacher(data=spiked(steps)), sentinel, steps)

    assert [(t.step, t.kind, t.replayed) for t in sentinel.trips] == [(SPIKE, "loss_spike", True)]
    _assert_same_training(plain, watched)


def test_a_teacher_too_large_to_copy_is_not_replayed_and_training_is_unchanged():
    # 16.8 M float32 entries in 2.weight (64.0 MiB): 0.weight and 0.bias are saved first, then 2.weight would bring
    # the copies over REPLAY_SAVE_BYTES, so the replay stops before writing it and puts 0.weight and 0.bias back.
    def big() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1))

    assert big()[2].weight.numel() * 4 + 4096 * 5 * 4 > REPLAY_SAVE_BYTES
    steps = SPIKE + 2
    plain = fit(lambda: MeanTeacher(model=big(), data=spiked(steps)), None, steps)
    sentinel = callback()
    logger = RecordingLogger()
    watched = fit(lambda: MeanTeacher(model=big(), data=spiked(steps)), sentinel, steps, logger=logger)

    [trip] = sentinel.trips
    assert (trip.step, trip.kind, trip.replayed) == (SPIKE, "loss_spike", False)
    assert "writes in place into teacher.2.weight" in trip.reason
    assert "over the limit of 64.0 MiB" in trip.reason
    assert "undid its earlier writes" in trip.reason
    spike = [f for f in sentinel.findings if f.rule == "loss_spike"]
    assert [f.step for f in spike] == [SPIKE]
    assert "not replayed because training_step writes in place into teacher.2.weight" in spike[0].message
    _assert_same_training(plain, watched)
    # The step's parameter statistics are still logged, and the next step is sampled.
    logged = {step for step, metrics in logger.ours() if "layer_health/param_norm/model.0.weight" in metrics}
    assert {SPIKE, SPIKE + 1} <= logged


# ------------------------------------------------------------------------------------------- dataloader_iter
class FromIterator(TinyModule):
    """A ``training_step`` that draws its own batch from ``dataloader_iter``."""

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:
        batch, _, _ = next(dataloader_iter)
        x, y = batch
        return self.loss(self(x), y)


def test_a_training_step_that_takes_dataloader_iter_is_not_replayed_and_says_why():
    steps = SPIKE + 3
    sentinel = callback()
    logger = RecordingLogger()
    with pytest.warns(UserWarning, match="dataloader_iter"):  # Lightning's: the signature is experimental
        fit(lambda: FromIterator(data=spiked(steps)), sentinel, steps, logger=logger)

    [trip] = sentinel.trips
    assert (trip.step, trip.kind, trip.replayed) == (SPIKE, "loss_spike", False)
    assert trip.reason.startswith("training_step takes dataloader_iter")
    assert "raised" not in trip.reason
    logged = {step for step, metrics in logger.ours() if "layer_health/param_norm/model.0.weight" in metrics}
    assert {SPIKE, SPIKE + 1} <= logged


# ------------------------------------------------------------------------------------------- self.log
class OwnLog(TinyModule):
    """A LightningModule that sets its own ``self.log``: a wrapper that puts every key under ``user/``."""

    def __init__(self, data: TensorDataset) -> None:
        super().__init__(data=data)
        self.record_enabled = False
        method = self.log

        def log(name: str, value: Any, **kwargs: Any) -> None:
            method(f"user/{name}", value, **kwargs)

        self.wrapper = log
        self.log = log

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, on_step=True)
        return loss


def test_a_replay_keeps_the_users_own_instance_log():
    steps = SPIKE + 4
    plain_log, watched_log = RecordingLogger(), RecordingLogger()
    fit(lambda: OwnLog(spiked(steps)), None, steps, logger=plain_log, log_every_n_steps=1)
    sentinel = callback()
    module = fit(lambda: OwnLog(spiked(steps)), sentinel, steps, logger=watched_log, log_every_n_steps=1)

    assert [(t.step, t.replayed) for t in sentinel.trips] == [(SPIKE, True)]
    assert module.__dict__["log"] is module.wrapper

    def users(log: RecordingLogger) -> list[tuple[int | None, dict[str, float]]]:
        calls = [(s, {k: v for k, v in m.items() if not k.startswith("layer_health")}) for s, m in log.calls]
        return [(s, m) for s, m in calls if m]

    assert users(watched_log) == users(plain_log)
    assert {k for _, m in users(watched_log) for k in m} == {"user/loss", "epoch"}
    assert len(users(watched_log)) == steps
