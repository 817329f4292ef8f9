"""A module with every source of randomness and state a replay must restore: dropout, BatchNorm, a torchmetrics
metric, ``self.log`` and Python's RNG."""

from __future__ import annotations

import random

import torch
from torch import nn
from torchmetrics import MeanMetric

from .fit import TinyModule, make_data, make_trainer


class Dropping(TinyModule):
    """Dropout and BatchNorm in the model, a torchmetrics metric and self.log in training_step, Python RNG too."""

    def __init__(self) -> None:
        model = nn.Sequential(
            nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16), nn.ReLU(),
            nn.Dropout(0.2), nn.Linear(16, 1),
        )  # fmt: skip
        super().__init__(model=model, data=make_data(n=64), optimizer="adam", lr=1e-2)
        self.record_enabled = False
        self.mean_out = MeanMetric()
        self.steps_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.steps_seen.append(self.global_step)
        out = self(x)
        loss = self.loss(out, y)
        self.mean_out(out.detach().mean())
        self.log("user/loss", loss)
        self.log("user/noise", torch.rand(()) + random.random())  # the RNG streams training continues with
        self.log("user/mean_out", self.mean_out, on_step=False, on_epoch=True)
        return loss


def fit_dropping(callbacks, logger, max_steps=8, **kwargs) -> Dropping:
    torch.manual_seed(0)
    random.seed(0)
    module = Dropping()
    make_trainer(callbacks, max_steps=max_steps, logger=logger, **kwargs).fit(module)
    return module
