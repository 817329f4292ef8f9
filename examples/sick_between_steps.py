"""Sick network 4: a NaN born between two sampled steps, caught on its own step by the sentinel.

A 13-layer MLP (``net.0`` ... ``net.12``) is observed every 10 optimizer steps. ``net.8`` stands in for a numerically
unsafe op that produces NaN on step 13 only, which is *not* a sampled step. Without the sentinel
(``--sentinel none``) nothing is seen until step 20, when the optimizer has already spread the NaN into the weights:
the finding then says the weights are non-finite and when they were last seen finite, but the origin is lost. With
the default sentinel (``"loss"``) the non-finite loss of step 13 trips it, the step is replayed with hooks before
the optimizer applies it, and the finding names ``net.8`` on step 13; with ``on_anomaly="raise"`` (the default here)
training stops there, with every weight still finite:

    python examples/sick_between_steps.py                    # raises at step 13 naming net.8
    python examples/sick_between_steps.py --on-anomaly warn  # warns at step 13, training goes on (NaN weights)
    python examples/sick_between_steps.py --sentinel none --on-anomaly warn   # the late, origin-less report
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from _common import DEFAULT_LOG_DIR, ON_ANOMALY, SequentialRegressor, exit_code, make_dataset, quiet_lightning, run
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthError

NAME = "sick_between_steps"
D_IN = 16
WIDTH = 32
SICK_STEP = 13
EVERY_N_STEPS = 10
MAX_STEPS = 25


class NaNOnStep(nn.Module):
    """Identity, except NaN in every output while the model trains on optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self.current = -1  # set by the LightningModule before each training step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if self.current == self.step else x


class Regressor(SequentialRegressor):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.net[8].current = self.global_step
        return super().training_step(batch, batch_idx)


def build_model() -> Regressor:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(D_IN, WIDTH), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers[8:8] = [NaNOnStep(SICK_STEP)]  # net.8, between net.7 (ReLU) and net.9 (Linear)
    layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)]
    return Regressor(nn.Sequential(*layers), optimizer="sgd", lr=0.05)


def make_callback(on_anomaly: str = "raise", sentinel: str | None = "loss") -> LayerHealthCallback:
    return LayerHealthCallback(every_n_steps=EVERY_N_STEPS, on_anomaly=on_anomaly, sentinel=sentinel)


def train(log_dir: str, callback: LayerHealthCallback) -> LayerHealthCallback:
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
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--log-dir", default=DEFAULT_LOG_DIR)
    parser.add_argument("--on-anomaly", choices=ON_ANOMALY, default="raise")
    parser.add_argument("--sentinel", choices=("loss", "loss+grads", "none"), default="loss")
    args = parser.parse_args(argv)
    callback = make_callback(args.on_anomaly, None if args.sentinel == "none" else args.sentinel)
    try:
        train(args.log_dir, callback)
    except LayerHealthError as err:
        print(f"\ntraining stopped with LayerHealthError:\n{err}")
    for trip in callback.trips:
        how = "replayed" if trip.replayed else f"not replayed: {trip.reason}"
        print(f"sentinel: step {trip.step} tripped ({trip.kind}, loss={trip.loss:.3g}), {how}")
    return callback


if __name__ == "__main__":
    quiet_lightning()
    raise SystemExit(exit_code(main()))
