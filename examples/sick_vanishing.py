"""Sick network 1: vanishing gradients in a deep sigmoid MLP.

Ten ``Linear`` + ``Sigmoid`` blocks with PyTorch's default ``nn.Linear`` initialisation. The sigmoid's derivative
is at most 1/4 and default-initialised weights shrink the gradient further, so the gradient of the loss with
respect to each layer's output loses roughly an order of magnitude per block on its way back to the input: the
first blocks get gradients ten orders of magnitude smaller than the head and barely learn.

What the callback should say: ``vanishing_gradient`` naming the first layer, in backward order (from the head
towards the input), from which no layer down to the input receives an ``act_grad_norm`` of ``vanishing_ratio``
(default ``1e-3``) times the head's - on this chain, where the gradient fades monotonically, that is the first layer
whose own ratio drops below it: a layer in the middle of the network - and nothing else. The heatmap of
``act_grad_norm`` shows the gradient fading with depth:

    python examples/sick_vanishing.py
    hookdiag report hookdiag_logs/sick_vanishing/version_0 --stat act_grad_norm
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from _common import SequentialRegressor, exit_code, make_dataset, mlp, parse_args, quiet_lightning, run
from torch import nn

from lightning_hookdiag import LayerHealthCallback

NAME = "sick_vanishing"
DEPTH = 10
WIDTH = 32
D_IN = 16
MAX_STEPS = 20


def build_model() -> SequentialRegressor:
    torch.manual_seed(0)
    return SequentialRegressor(mlp([D_IN] + [WIDTH] * DEPTH, nn.Sigmoid), optimizer="sgd", lr=0.1)


def make_callback(on_anomaly: str = "warn") -> LayerHealthCallback:
    return LayerHealthCallback(every_n_steps=1, on_anomaly=on_anomaly)


def train(log_dir: str | Path, callback: LayerHealthCallback) -> LayerHealthCallback:
    return run(build_model(), make_dataset(d_in=D_IN), callback, log_dir=log_dir, name=NAME, max_steps=MAX_STEPS)


def main(argv: Sequence[str] | None = None) -> LayerHealthCallback:
    args = parse_args(argv, __doc__)
    return train(args.log_dir, make_callback(args.on_anomaly))


if __name__ == "__main__":
    quiet_lightning()
    raise SystemExit(exit_code(main()))
