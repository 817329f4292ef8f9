"""Gradient-side statistics under manual optimization and several optimizers, against values the module records."""

import math

import lightning.pytorch as pl
import pytest
import torch
from helpers import RecordingLogger, make_data, make_trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_hookdiag import LayerHealthCallback

P = "layer_health"


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers stepping disjoint parts, recording the truth as it goes."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
        self.b = nn.Linear(6, 1)
        self.truth: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        truth: dict[str, float] = {"step": float(self.global_step)}
        before = {n: p.detach().clone() for n, p in self.named_parameters()}

        h = self.a[0](x)
        h.retain_grad()
        out = self.b(self.a[1](h))
        out.retain_grad()
        loss = nn.functional.mse_loss(out, y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        truth["act_grad_norm/a.0"] = h.grad.norm().item()
        truth["act_grad_norm/b"] = out.grad.norm().item()
        for n, p in self.named_parameters():
            truth[f"param_grad_norm/{n}"] = p.grad.norm().item()
            truth[f"param_norm/{n}"] = before[n].norm().item()
        opt_a.step()
        opt_b.step()
        for n, p in self.named_parameters():
            truth[f"param_update_ratio/{n}"] = (p.detach() - before[n]).norm().item() / before[n].norm().item()
        self.truth.append(truth)

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.Adam(self.b.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(make_data(n=32), batch_size=8)


def test_manual_optimization_with_two_optimizers():
    module = TwoOptimizers()
    logger = RecordingLogger()
    make_trainer([LayerHealthCallback(every_n_steps=2)], max_steps=8, logger=logger).fit(module)
    calls = logger.ours()
    # Two optimizer steps per batch: global_step at batch start is 0, 2, 4, 6 — every batch is sampled.
    assert [s for s, _ in calls] == [0, 2, 4, 6]
    truth_by_step = {int(t["step"]): t for t in module.truth}
    for step, metrics in calls:
        truth = truth_by_step[step]
        for key, value in truth.items():
            if key == "step":
                continue
            assert metrics[f"{P}/{key}"] == pytest.approx(value, rel=1e-5), key
        total = math.sqrt(sum(v**2 for k, v in truth.items() if k.startswith("param_grad_norm/")))
        assert metrics[f"{P}/grad_norm_total"] == pytest.approx(total, rel=1e-5)


class ManualAccumulation(TwoOptimizers):
    """Steps only every second batch: statistics pool both batches of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.initial_a0 = {k: v.clone() for k, v in self.a[0].state_dict().items()}

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss = nn.functional.mse_loss(self.b(self.a(x)), y) / 2
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            opt_a.step()
            opt_b.step()
            opt_a.zero_grad()
            opt_b.zero_grad()


def test_manual_accumulation_pools_until_the_optimizer_steps():
    module = ManualAccumulation()
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_mean"])
    make_trainer([callback], max_steps=4, logger=logger).fit(module)
    calls = logger.ours()
    assert [s for s, _ in calls] == [0, 2]
    # Step 0 saw batches 0 and 1 (16 rows) with the initial weights of a.0: recompute the pooled mean by hand.
    x = module.train_dataloader().dataset.tensors[0][:16]
    layer = nn.Linear(4, 6)
    layer.load_state_dict(module.initial_a0)
    values = layer(x).reshape(-1).tolist()
    assert calls[0][1][f"{P}/act_mean/a.0"] == pytest.approx(sum(values) / len(values), rel=1e-5)
