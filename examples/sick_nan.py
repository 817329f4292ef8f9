"""Sick network 3: a NaN born in the middle of the network.

``net.unsafe_log`` stands in for a numerically unsafe custom op (a ``log`` whose input guard was lost in a
refactor): it passes its input through for its first ``HEALTHY_STEPS`` training steps, then returns ``log(x)``,
which is NaN wherever ``x < 0`` - about half of the outputs of the ``Linear`` before it. Every layer after it is
non-finite too (a NaN entering a matmul spreads to every output), and so are the loss and every gradient.

What the callback should say, on the first step with NaN: ``nonfinite`` naming ``net.unsafe_log`` - the first
non-finite layer in forward order, where the NaN was born - not ``fc3``/``relu3``/``head`` after it; a second
``nonfinite`` finding names ``net.head``, where the non-finite *gradient* starts on the way back. By default this
example runs with ``on_anomaly="raise"``: training stops on that step with a ``LayerHealthError`` whose message
starts with the origin. With ``--on-anomaly warn`` training goes on, the NaN gradients poison every weight, and on
the next step the callback (correctly) reports ``net.fc1`` as the first non-finite layer:

    python examples/sick_nan.py                      # raises, prints the error and the findings
    python examples/sick_nan.py --on-anomaly warn
    hookdiag report hookdiag_logs/sick_nan/version_0 --stat act_nonfinite
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from _common import SequentialRegressor, exit_code, make_dataset, parse_args, quiet_lightning, run
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthError

NAME = "sick_nan"
WIDTH = 32
D_IN = 16
HEALTHY_STEPS = 5
MAX_STEPS = 10


class UnsafeLog(nn.Module):
    """Identity for its first ``healthy_calls`` training-mode calls, then ``log(x)``: NaN wherever ``x < 0``."""

    def __init__(self, healthy_calls: int) -> None:
        super().__init__()
        self.healthy_calls = healthy_calls
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls > self.healthy_calls:
                return torch.log(x)
        return x


def build_model() -> SequentialRegressor:
    torch.manual_seed(0)
    net = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(D_IN, WIDTH),
            relu1=nn.ReLU(),
            fc2=nn.Linear(WIDTH, WIDTH),
            unsafe_log=UnsafeLog(healthy_calls=HEALTHY_STEPS),
            fc3=nn.Linear(WIDTH, WIDTH),
            relu3=nn.ReLU(),
            head=nn.Linear(WIDTH, 1),
        )
    )
    return SequentialRegressor(net, optimizer="sgd", lr=0.05)


def make_callback(on_anomaly: str = "raise") -> LayerHealthCallback:
    return LayerHealthCallback(every_n_steps=1, on_anomaly=on_anomaly)


def train(log_dir: str | Path, callback: LayerHealthCallback) -> LayerHealthCallback:
    return run(
        build_model(),
        make_dataset(d_in=D_IN),
        callback,
        log_dir=log_dir,
        name=NAME,
        max_steps=MAX_STEPS,
        stat="act_nonfinite",
    )


def main(argv: Sequence[str] | None = None) -> LayerHealthCallback:
    args = parse_args(argv, __doc__, default_on_anomaly="raise")
    callback = make_callback(args.on_anomaly)
    try:
        train(args.log_dir, callback)
    except LayerHealthError as err:
        print(f"\ntraining stopped with LayerHealthError:\n{err}")
    return callback


if __name__ == "__main__":
    quiet_lightning()
    raise SystemExit(exit_code(main()))
