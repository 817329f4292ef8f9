"""Defects that Lightning's own test suite found with the callback in every Trainer (``benchmarks/lightning_suite.py``).

Each is reproduced here on a real fit, in the shape of the Lightning test that found it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock, Mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import TinyModule, count_hooks, make_data, make_trainer
from torch import nn

from lightning_hookdiag import LayerHealthCallback


class SnapshotInTrainingStep(pl.LightningModule):
    """Manual optimization that deep-copies its layer after the forward (``test_model_checkpoint_manual_opt``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.automatic_optimization = False
        self.snapshots: list[nn.Module] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.layer(batch[0])
        loss = nn.functional.binary_cross_entropy_with_logits(out, batch[1])
        self.snapshots.append(copy.deepcopy(self.layer))  # while our hooks are on the layer
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("stats", [None, ["act_mean", "act_saved_bytes"]], ids=["default", "saved bytes"])
def test_a_module_deep_copied_during_a_sampled_step_does_not_drag_our_state_along(stats):
    module = SnapshotInTrainingStep()
    data = torch.utils.data.TensorDataset(torch.randn(4, 3), torch.randint(0, 2, (4, 1)).float())
    callback = LayerHealthCallback(every_n_steps=1, stats=stats, output={"summary": False})
    trainer = make_trainer([callback], max_steps=3)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
    assert len(module.snapshots) == 3
    assert callback.last_step == 2
    # Each copy runs as the layer did and holds the weights of its step.
    assert all(isinstance(copy_, nn.Linear) for copy_ in module.snapshots)
    assert count_hooks(module) == 0


@pytest.mark.parametrize("stand_in", [Mock, MagicMock], ids=["Mock", "MagicMock"])
def test_a_stand_in_logger_gets_the_scalars_and_no_file_is_written_for_it(stand_in, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a MagicMock converts to a path relative to here
    logger = stand_in(name="logger")  # as the mock loggers of Lightning's test_hparams.py and throughput tests
    if stand_in is MagicMock:
        del logger.__iter__  # else Lightning takes it for a list of loggers (an empty one)
    callback = LayerHealthCallback(every_n_steps=2, output={"summary": False})
    module = TinyModule(data=make_data(n=32))
    module.record_enabled = False
    make_trainer([callback], max_steps=4, logger=logger).fit(module)
    calls = logger.log_metrics.call_args_list
    steps = [call.kwargs.get("step") for call in calls if "layer_health/alerts_active" in call.args[0]]
    assert steps == [0, 2]
    assert list(Path(tmp_path).iterdir()) == []


class ScheduledByEpoch(TinyModule):
    """SGD with a StepLR stepped by Lightning once per epoch, as ``test_stochastic_weight_avg.py``'s models."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)}


@pytest.mark.parametrize("annealing", ["cos", "linear"])
def test_a_scheduler_swapped_in_by_stochastic_weight_averaging_is_not_overstepped(annealing):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    module = ScheduledByEpoch(data=make_data(n=32))  # 4 batches of 8: 4 optimizer steps per epoch
    module.record_enabled = False
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_strategy=annealing)
    health = LayerHealthCallback(
        every_n_steps=1, rules={"enabled": ["scheduler_overstepped"]}, output={"summary": False}
    )
    make_trainer([health, swa], max_steps=-1, max_epochs=5).fit(module)
    assert health.last_step == 19  # every step of 5 epochs was sampled, across the swap at epoch 2
    assert health.findings == []


class SteppedTwice(ScheduledByEpoch):
    """The same schedule, also stepped by the user in ``training_step``: the rule's own case."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.lr_schedulers().step()
        return super().training_step(batch, batch_idx)


def test_the_same_schedule_stepped_by_the_user_too_is_still_named():
    module = SteppedTwice(data=make_data(n=32))
    module.record_enabled = False
    health = LayerHealthCallback(
        every_n_steps=1, on_anomaly="ignore", rules={"enabled": ["scheduler_overstepped"]}, output={"summary": False}
    )
    make_trainer([health], max_steps=-1, max_epochs=2).fit(module)
    assert [f.rule for f in health.findings][:1] == ["scheduler_overstepped"]
