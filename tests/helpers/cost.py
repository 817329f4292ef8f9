"""Instruments of the cost tests: host transfers counted while the callback's hooks run, on a module whose own
training step makes none, around deep MLPs."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from lightning_hookdiag import LayerHealthCallback

from .fit import TinyModule

# Tensor methods that force a device-to-host copy (and so a sync on an accelerator).
SYNCING = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextmanager
def count_host_transfers(counter: dict[str, int]):
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            if counter["active"]:
                counter["calls"] += 1
                counter.setdefault(name, 0)
                counter[name] += 1
                counter.setdefault("devices", set()).add(self.device.type)
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class CountingCallback(LayerHealthCallback):
    """Counts host transfers made while any of the callback's hooks or its tensor hooks run."""

    def __init__(self, counter, **kwargs):
        super().__init__(**kwargs)
        self.counter = counter
        self.per_step: dict[int, int] = {}

    def _counted(self, method, *args):
        self.counter["active"] = True
        try:
            return method(*args)
        finally:
            self.counter["active"] = False

    def on_train_batch_start(self, *args):
        self._step = args[0].global_step
        self.counter["calls"] = 0
        self._counted(super().on_train_batch_start, *args)
        self.counter["active"] = True  # forward and backward hooks of the package run during the batch

    def on_before_optimizer_step(self, *args):
        self._counted(super().on_before_optimizer_step, *args)

    def on_train_batch_end(self, *args):
        self._counted(super().on_train_batch_end, *args)
        self.per_step[self._step] = self.counter["calls"]


def deep_mlp(blocks: int) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(blocks):
        layers += [nn.Linear(4 if i == 0 else 16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 1))


class SyncFreeModule(TinyModule):
    """A module whose own training step makes no host transfer, so every counted transfer is the package's."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss(self(x), y)
