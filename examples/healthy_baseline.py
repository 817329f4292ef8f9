"""The control: a healthy network on which the callback must stay silent.

A three-block ReLU MLP with He (Kaiming) initialisation and zero biases, trained with Adam on a learnable
regression task, batch 64. Activations keep their scale through depth, no ReLU unit is dead for a whole batch, the
output gradient keeps its norm within an order of magnitude from the head to the input, nothing is NaN and the loss
goes down.

What the callback should say: nothing - ``callback.findings == []`` and no ``LayerHealthWarning`` - while still
logging every statistic, so the heatmaps of this run are the reference to compare the sick ones with:

    python examples/healthy_baseline.py
    hookdiag report hookdiag_logs/healthy_baseline/version_0 --stat act_grad_norm
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from _common import SequentialRegressor, exit_code, make_dataset, mlp, parse_args, quiet_lightning, run
from torch import nn

from lightning_hookdiag import LayerHealthCallback

NAME = "healthy_baseline"
WIDTH = 64
D_IN = 16
MAX_STEPS = 40


def build_model() -> SequentialRegressor:
    torch.manual_seed(0)
    net = mlp([D_IN, WIDTH, WIDTH, WIDTH], nn.ReLU)
    for module in net.modules():
        if isinstance(module, nn.Linear):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            nn.init.zeros_(module.bias)
    return SequentialRegressor(net, optimizer="adam", lr=3e-3)


def make_callback(on_anomaly: str = "warn") -> LayerHealthCallback:
    return LayerHealthCallback(every_n_steps=2, on_anomaly=on_anomaly)


def train(log_dir: str | Path, callback: LayerHealthCallback) -> LayerHealthCallback:
    return run(build_model(), make_dataset(d_in=D_IN), callback, log_dir=log_dir, name=NAME, max_steps=MAX_STEPS)


def main(argv: Sequence[str] | None = None) -> LayerHealthCallback:
    args = parse_args(argv, __doc__)
    return train(args.log_dir, make_callback(args.on_anomaly))


if __name__ == "__main__":
    quiet_lightning()
    raise SystemExit(exit_code(main()))
