"""Regressions of issue 35 in the rules, each on a real Trainer fit that reproduced it.

* a NaN made in backward is named where the gradient went non-finite, not at a layer the optimizer step then broke;
* an attention finding present at initialisation says so, and points at the inputs' scale and the initialisation;
* a residual branch behind a zero-initialised norm that starts learning is no ``update_jump``;
* the output-logit rules hold only where the output feeds a softmax or a sigmoid loss (not ``BoringModel``'s
  regression head).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from helpers import RecordingLogger, TinyModule, by_name, make_data, make_trainer
from helpers.zoo import ResNet18, ZooModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.demos.transformer import LightningTransformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback

# ------------------------------------------------------------------ item 9: a NaN made in backward, with clipping


class _NanBackward(torch.autograd.Function):
    """The identity forward; its backward writes NaN into the first row of the gradient when ``bad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bad: bool) -> torch.Tensor:
        ctx.bad = bad
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.bad:
            grad = grad.clone()
            grad[0] = math.nan
        return grad, None


class _NanGate(nn.Module):
    """A parameterless module whose backward makes NaN on the step its flag is set (its forward stays finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NanBackward.apply(x, self.bad)


def _nan_in_backward_fit(bad_step: int, clip: float | None) -> tuple[LayerHealthCallback, list[float]]:
    gate = _NanGate()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.Linear(16, 16),  # model.5: its output gradient is the first to receive the NaN
        gate,
        nn.ReLU(),
        nn.Linear(16, 16),  # model.8: downstream, finite gradients; clipping by the NaN total norm breaks it
        nn.ReLU(),
        nn.Linear(16, 1),
    )
    module = TinyModule(net, data=make_data(256), lr=0.01)
    losses: list[float] = []

    def on_step(m: TinyModule, batch_idx: int) -> None:
        gate.bad = m.global_step == bad_step

    module.on_step = on_step
    module.record_enabled = False
    original = module.training_step

    def training_step(batch, batch_idx):
        loss = original(batch, batch_idx)
        losses.append(float(loss))
        return loss

    module.training_step = training_step
    callback = LayerHealthCallback(
        every_n_steps=5, sentinel="loss+grads", on_anomaly="ignore", output={"summary": False}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([callback], max_steps=bad_step + 2, gradient_clip_val=clip).fit(module)
    return callback, losses


def test_a_nan_made_in_backward_is_named_at_the_first_nonfinite_output_gradient_not_at_the_optimizer_update():
    callback, losses = _nan_in_backward_fit(bad_step=13, clip=1.0)
    assert math.isfinite(losses[13])  # the loss of the step stayed finite: only backward made the NaN
    at_13 = [f for f in callback.findings if f.step == 13]
    assert [(f.rule, f.layer, f.stat) for f in at_13][0] == ("nonfinite", "model.5", "act_grad_nonfinite")
    assert at_13[0].value == 16  # the one NaN row of the 16-wide output gradient
    # Clipping by the (NaN) total norm made the downstream layers' finite gradients NaN before the update: the
    # update did not make the NaN, so no finding blames it; the origin's finding says where it spread.
    assert not any(f.stat == "param_update_ratio" for f in callback.findings)
    assert not any("wrote NaN/Inf into finite weights" in f.message for f in callback.findings)
    assert "the optimizer update then made model.8.weight, model.8.bias, model.10.weight, ..." in at_13[0].message
    assert "(4 parameters in 2 layers, the first in forward order: model.8)" in at_13[0].message


def test_a_nan_made_in_backward_without_clipping_names_the_same_origin():
    # The twin without clipping: the downstream weights stay finite, and the origin is the same.
    callback, _ = _nan_in_backward_fit(bad_step=13, clip=None)
    at_13 = [f for f in callback.findings if f.step == 13]
    assert [(f.rule, f.layer, f.stat) for f in at_13] == [("nonfinite", "model.5", "act_grad_nonfinite")]
    assert "optimizer update" not in at_13[0].message


# ----------------------------------------------- item 12: a branch behind a zero-initialised norm starts to learn


class _ExactUpdateRatio(Callback):
    """The update ratio of one weight, computed from a float64 copy taken before each optimizer step."""

    def __init__(self, weight: Callable[[pl.LightningModule], torch.Tensor]) -> None:
        self.weight, self.ratios, self._before = weight, [], None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._before = self.weight(pl_module).detach().double().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        after = self.weight(pl_module).detach().double()
        self.ratios.append(((after - self._before).norm() / self._before.norm()).item())


def test_resnet18_with_zero_init_last_at_timms_widths_raises_no_update_jump():
    # timm's resnet18 at its real widths (64 to 512 channels) with zero_init_last. Behind its zero bn2.weight, layer4's
    # conv2 moves by AdamW's weight decay alone on step 0 (lr * wd = 1e-5 of its norm), then by Adam's whole update,
    # ~1,000x more: the branch starts to learn, which is no jump to report. Its weight is sampled for the ratio, and at
    # 1 x 1 resolution only the centre tap of each 3 x 3 kernel gets a gradient: a stride of 9 once read the centre
    # taps on every 9th step only, so the logged ratio swung between 1e-5 and 2e-2 while the real one fell smoothly.
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8 * 12, 3, 32, 32, generator=g), torch.randint(0, 10, (8 * 12,), generator=g))
    module = ZooModule(ResNet18(width=64), "classify", data)
    assert all(float(b.bn2.weight.abs().sum()) == 0.0 for b in module.model.layer4)
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    exact = _ExactUpdateRatio(lambda m: m.model.layer4[1].conv2.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([exact, callback], max_steps=12, logger=logger).fit(module)
    key = "layer_health/param_update_ratio/model.layer4.1.conv2.weight"
    logged = [metrics[key] for _, metrics in logger.ours() if key in metrics]
    assert logged[0] == pytest.approx(1e-3 * 1e-2, rel=1e-2)  # step 0: AdamW's decay alone, lr * weight_decay
    assert logged == pytest.approx(exact.ratios, rel=0.05)  # a sample of the weight, on every step
    assert min(exact.ratios[1:]) > 500 * exact.ratios[0]
    assert [f.message for f in callback.findings] == []


# ------------------------------------------- item 13: the output-logit rules only where a softmax/sigmoid loss reads


class _Boring(BoringModel):
    """Lightning's ``BoringModel`` (a 2-unit head trained by MSE towards 1), or with a cross entropy on that head.

    ``shift`` is added to both units' bias after every optimizer step: the softmax does not see it, the MSE does.
    """

    def __init__(self, loss: str = "mse", shift: float = 0.0) -> None:
        super().__init__()
        self.loss_name, self.shift = loss, shift

    def loss(self, preds: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.loss_name == "cross_entropy":
            return nn.functional.cross_entropy(preds, torch.zeros(len(preds), dtype=torch.long))
        return super().loss(preds, labels)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        with torch.no_grad():
            self.layer.bias.add_(self.shift)


def _boring_fit(module: BoringModel, steps: int = 40) -> LayerHealthCallback:
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([callback], max_steps=steps).fit(module)
    return callback


def test_boring_models_regression_head_gets_no_logit_drift():
    # BoringModel's output is a regression head: its log Z moves as MSE pulls it to 1, and no softmax reads it.
    callback = _boring_fit(_Boring())
    assert "layer_health/logit_lse_mean/layer" in by_name(callback.last_metrics)  # still measured and logged
    assert [f.message for f in callback.findings] == []


def test_the_same_head_under_a_cross_entropy_is_named_when_its_log_z_drifts_under_a_flat_loss():
    torch.manual_seed(0)
    drifting = _boring_fit(_Boring("cross_entropy", shift=0.5), steps=20)
    first = drifting.findings[0]
    assert (first.rule, first.layer, first.stat) == ("logit_drift", "layer", "logit_lse_mean")
    # The twin: the same shift under the MSE moves the loss, and the rule does not hold for a regression head.
    torch.manual_seed(0)
    regression = _boring_fit(_Boring("mse", shift=0.5), steps=20)
    assert not any(f.rule == "logit_drift" for f in regression.findings)


# ------------------------------------------------- item 11: attention logits that are one-hot from initialisation


class _DemoTransformer(LightningTransformer):
    """Lightning's demo transformer (``ninp=200``: its embedding is multiplied by sqrt(200)) on random tokens."""

    def prepare_data(self) -> None:  # the demo downloads WikiText-2 here
        pass

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 100, (16, 17), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def test_attention_logits_one_hot_from_initialisation_point_at_the_inputs_scale_not_the_learning_rate():
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([callback], max_steps=2).fit(_DemoTransformer(vocab_size=100))
    at_0 = [f for f in callback.findings if f.step == 0]
    assert [(f.rule, f.layer) for f in at_0] == [
        ("attention_logits", "model.transformer.encoder.layers.0.self_attn"),
        ("attention_logits", "model.transformer.decoder.layers.0.self_attn"),
    ]
    for finding in at_0:
        assert finding.value > 50
        assert "at step 0, before any optimizer update" in finding.message
        assert "RMS of its inputs" in finding.message
        assert "lower learning rate keeps it bounded" not in finding.message
    # Still there at step 1 (an alert already raised, so not in findings again): it was so at step 0, and it says so.
    assert callback.last_step == 1
    assert [f.layer for f in callback.last_findings] == [f.layer for f in at_0]
    assert all(" at step 0, before any optimizer update" in f.message for f in callback.last_findings)
