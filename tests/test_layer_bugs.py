"""Issue 20's layer bugs in real Lightning fits, each with its fixed twin: a detached body (``no_gradient``), a ReLU
RNN whose gradient explodes through time (``exploding_gradient`` located in the RNN), a ``self.eval()`` left on in
``training_step`` (``eval_mode``), and metrics and losses kept on the module (not selected by default)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import RecordingLogger, make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning

P = "layer_health"


def _fit(module: pl.LightningModule, steps: int, **callback_args: Any) -> tuple[LayerHealthCallback, list[str]]:
    """Fit with every step sampled; the callback and the messages of every LayerHealthWarning."""
    callback = LayerHealthCallback(every_n_steps=1, summary=False, **callback_args)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer([callback], max_steps=steps, logger=RecordingLogger()).fit(module)
    return callback, [str(w.message) for w in record if issubclass(w.category, LayerHealthWarning)]


# ------------------------------------------------------------------------------------------ metrics and losses
class _WithMetrics(pl.LightningModule):
    """A classifier keeping a torchmetrics Accuracy and MeanSquaredError and a loss module, called in training_step."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.train_acc = torchmetrics.classification.Accuracy(task="multiclass", num_classes=3)
        self.train_mse = torchmetrics.MeanSquaredError()  # its output requires grad: it used to warn
        self.loss_fn = nn.CrossEntropyLoss()
        self.batch_accuracy: list[float] = []  # by hand, the reference for act_mean/train_acc

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        self.batch_accuracy.append(float((logits.argmax(-1) == y).double().mean()))
        self.train_acc(logits, y)
        self.train_mse(logits.softmax(-1).amax(-1), torch.ones_like(y, dtype=logits.dtype))
        self.log("train_acc", self.train_acc)
        return self.loss_fn(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
        return DataLoader(data, batch_size=8)


def test_metrics_and_losses_on_the_module_are_not_observed_by_default():
    pytest.importorskip("torchmetrics")
    callback, warned = _fit(_WithMetrics(), steps=3)
    assert warned == []
    assert callback.findings == []
    observed = {key.rsplit("/", 1)[1] for key in callback.last_metrics if key.count("/") == 2}
    assert observed == {"model.0", "model.1", "model.2", "model.0.weight", "model.0.bias", "model.2.weight",
                        "model.2.bias"}  # fmt: skip
    assert callback.layer_names == ["model.0", "model.1", "model.2"]


def test_metrics_and_losses_stay_selectable_by_name():
    pytest.importorskip("torchmetrics")
    module = _WithMetrics()
    callback, _ = _fit(module, steps=2, layers=["model.2", "train_acc", "loss_fn"])
    assert callback.layer_names == ["model.2", "train_acc", "loss_fn"]
    # Accuracy's output is the batch accuracy; the loss module's output is the loss itself.
    assert callback.last_metrics[f"{P}/act_mean/train_acc"] == pytest.approx(module.batch_accuracy[-1], abs=1e-7)
    assert callback.last_metrics[f"{P}/act_grad_norm/loss_fn"] == pytest.approx(1.0)  # d(loss)/d(loss)
