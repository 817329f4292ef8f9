"""Sick network 2: a dead ReLU layer after a bad bias initialisation.

A three-block ReLU MLP in which the bias of ``fc3`` was initialised to ``-10`` (a typo for ``-0.1``, say). Its
pre-activations are far below zero for every input, so ``relu3`` outputs exactly 0 everywhere; a dead ReLU passes no
gradient, so its units can never recover, and nothing below it (``fc3`` and the blocks before) gets any gradient
either: only the head's bias learns. ``relu1`` and ``relu2`` are healthy in the forward pass.

What the callback should say: ``dead_units`` naming ``net.relu3`` (``act_dead_frac`` 1.0: every unit was ``<= 0``
for every sample) and no other ReLU; one finding for one cause, which also says the consequence: from ``net.fc3``,
the first layer in backward order whose output gradient is 0, to the input end, no layer gets a gradient. The
``act_dead_frac`` and ``act_grad_norm`` heatmaps show both:

    python examples/sick_dead_relu.py
    hookdiag report hookdiag_logs/sick_dead_relu/version_0 --stat act_dead_frac
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from _common import SequentialRegressor, exit_code, make_dataset, mlp, parse_args, quiet_lightning, run
from torch import nn

from lightning_hookdiag import LayerHealthCallback

NAME = "sick_dead_relu"
WIDTH = 64
D_IN = 16
BROKEN_LINEAR = "fc3"
DEAD_RELU = "relu3"
BAD_BIAS = -10.0
MAX_STEPS = 20


def build_model() -> SequentialRegressor:
    torch.manual_seed(0)
    net = mlp([D_IN, WIDTH, WIDTH, WIDTH], nn.ReLU)
    with torch.no_grad():
        getattr(net, BROKEN_LINEAR).bias.fill_(BAD_BIAS)
    return SequentialRegressor(net, optimizer="sgd", lr=0.05)


def make_callback(on_anomaly: str = "warn") -> LayerHealthCallback:
    return LayerHealthCallback(every_n_steps=2, on_anomaly=on_anomaly)


def train(log_dir: str | Path, callback: LayerHealthCallback) -> LayerHealthCallback:
    return run(
        build_model(),
        make_dataset(d_in=D_IN),
        callback,
        log_dir=log_dir,
        name=NAME,
        max_steps=MAX_STEPS,
        stat="act_dead_frac",
    )


def main(argv: Sequence[str] | None = None) -> LayerHealthCallback:
    args = parse_args(argv, __doc__)
    return train(args.log_dir, make_callback(args.on_anomaly))


if __name__ == "__main__":
    quiet_lightning()
    raise SystemExit(exit_code(main()))
