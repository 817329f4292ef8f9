"""Sick network 5: a dead block in the middle of a 48-layer ReLU network, and its healthy twin.

48 blocks of ``Linear(64) + ReLU`` and a head, an ``nn.Sequential`` under ``self.net``: the layers are ``net.0``
(the first Linear), ``net.1`` (its ReLU), ... ``net.95`` (the last ReLU) and ``net.96`` (the head). He (Kaiming)
weights and zero biases, Adam. One bias was initialised to -10 (the Linear ``net.60``): its pre-activations are far
below zero for every input, so the ReLU ``net.61`` outputs exactly 0 everywhere. With zero biases everything after
it is 0 too (every later ReLU is dead as well), no gradient flows back through it, and the 30 blocks below never
learn: only the head's bias does.

What the callback should say: the origin, ``net.61`` (``act_dead_frac`` 1.0 from there on, and the gradient
stopping at ``net.60``), on the first sampled step; the ``act_std`` heatmap is black from ``net.61`` down. With
``--healthy`` (no bias shift) it says nothing, while logging the same statistics.

Logs go to CSV, TensorBoard and, when ``mlflow`` is installed, MLflow (a file store under the log folder). The
README's screenshots of TensorBoard are made from this example by ``docs/screenshots.py``:

    python examples/sick_dead_block.py
    python examples/sick_dead_block.py --healthy
    hookdiag report hookdiag_logs/sick_dead_block/version_0 --stat act_dead_frac
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from _common import DEFAULT_LOG_DIR, ON_ANOMALY, SequentialRegressor, exit_code, make_dataset, quiet_lightning, run
from lightning.pytorch.loggers import Logger
from torch import nn

from lightning_hookdiag import LayerHealthCallback

NAME = "sick_dead_block"
HEALTHY_NAME = "sick_dead_block_healthy"
WIDTH = 64
D_IN = 16
BLOCKS = 48
BROKEN_LINEAR = 60  # index in net: the 31st Linear; its ReLU is net.61
BAD_BIAS = -10.0
MAX_STEPS = 100
EVERY_N_STEPS = 10


def build_model(healthy: bool = False) -> SequentialRegressor:
    """48 ``Linear + ReLU`` blocks and a head; unless ``healthy``, the bias of ``net.60`` is -10."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    fan_in = D_IN
    for _ in range(BLOCKS):
        layers += [nn.Linear(fan_in, WIDTH), nn.ReLU()]
        fan_in = WIDTH
    layers.append(nn.Linear(WIDTH, 1))
    net = nn.Sequential(*layers)
    for module in net.modules():
        if isinstance(module, nn.Linear):
            # He init keeps the activations' scale through 48 ReLU blocks; zero biases make the dead block's
            # zeros carry on to the head (a positive bias after it would give constant, not dead, units).
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            nn.init.zeros_(module.bias)
    if not healthy:
        broken = net[BROKEN_LINEAR]
        assert isinstance(broken, nn.Linear)
        with torch.no_grad():
            broken.bias.fill_(BAD_BIAS)
    return SequentialRegressor(net, optimizer="adam", lr=1e-3)


def make_callback(on_anomaly: str = "warn") -> LayerHealthCallback:
    return LayerHealthCallback(every_n_steps=EVERY_N_STEPS, on_anomaly=on_anomaly)


def mlflow_loggers(log_dir: str | Path, name: str) -> list[Logger]:
    """An ``MLFlowLogger`` with a file store in ``<log_dir>/mlruns`` (experiment ``name``), or none without mlflow."""
    if importlib.util.find_spec("mlflow") is None:
        return []
    from lightning.pytorch.loggers import MLFlowLogger

    # mlflow 3.7 and later refuse a file: tracking URI unless this is set (the file store is "in maintenance
    # mode"); the alternative, sqlite:, needs SQLAlchemy, which mlflow-skinny lacks. Set before the logger is made.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (Path(log_dir) / "mlruns").resolve()
    return [MLFlowLogger(experiment_name=name, tracking_uri=store.as_uri())]


def train(log_dir: str | Path, callback: LayerHealthCallback, healthy: bool = False) -> LayerHealthCallback:
    name = HEALTHY_NAME if healthy else NAME
    return run(
        build_model(healthy),
        make_dataset(d_in=D_IN),
        callback,
        log_dir=log_dir,
        name=name,
        max_steps=MAX_STEPS,
        stat="act_dead_frac",
        extra_loggers=mlflow_loggers(log_dir, name),
    )


def main(argv: Sequence[str] | None = None) -> LayerHealthCallback:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help=f"where the logs go (default: {DEFAULT_LOG_DIR})")
    parser.add_argument("--on-anomaly", choices=ON_ANOMALY, default="warn", help="default: warn")
    parser.add_argument("--healthy", action="store_true", help="the twin without the bias shift: nothing is wrong")
    args = parser.parse_args(argv)
    callback = train(args.log_dir, make_callback(args.on_anomaly), healthy=args.healthy)
    store = (Path(args.log_dir) / "mlruns").resolve()
    if store.exists():
        print(f"MLflow file store: {store.as_uri()} (experiment {HEALTHY_NAME if args.healthy else NAME})")
    return callback


if __name__ == "__main__":
    quiet_lightning()
    raise SystemExit(exit_code(main()))
