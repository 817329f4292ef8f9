"""Shared pieces of the sick-network examples: synthetic data, a LightningModule around an ``nn.Sequential``, and
:func:`run`, which trains with a :class:`~lightning_hookdiag.LayerHealthCallback` and a ``CSVLogger`` and prints
what the callback found, where the logs are and how to draw them.

Not an example itself; ``sick_*.py`` and ``healthy_baseline.py`` import it (run them from anywhere: Python puts the
script's folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback

DEFAULT_LOG_DIR = "hookdiag_logs"
ON_ANOMALY = ("warn", "raise", "stop", "ignore")


def make_dataset(n: int = 512, d_in: int = 16, seed: int = 0) -> TensorDataset:
    """A learnable regression task: ``y = tanh(x A) b`` plus a little noise, with ``x ~ N(0, I)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    a = torch.randn(d_in, 8, generator=g) / d_in**0.5
    b = torch.randn(8, 1, generator=g)
    y = torch.tanh(x @ a) @ b + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def mlp(sizes: Sequence[int], activation: Callable[[], nn.Module], d_out: int = 1) -> nn.Sequential:
    """``Linear`` + activation blocks named ``fc1, <act>1, fc2, <act>2, ...``, then a ``head`` Linear.

    Named children give readable layer names in the logs (``net.fc3``, ``net.relu3``) instead of ``net.4``.
    """
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True), start=1):
        layers[f"fc{i}"] = nn.Linear(fan_in, fan_out)
        act = activation()
        layers[f"{type(act).__name__.lower()}{i}"] = act
    layers["head"] = nn.Linear(sizes[-1], d_out)
    return nn.Sequential(layers)


class SequentialRegressor(pl.LightningModule):
    """MSE regression with ``self.net`` (so layers are named ``net.<child>``) and a configurable optimizer."""

    def __init__(self, net: nn.Sequential, optimizer: str = "sgd", lr: float = 0.1) -> None:
        super().__init__()
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer: expected 'sgd' or 'adam', got {optimizer!r}")
        self.net = net
        self.optimizer_name = optimizer
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def parse_args(argv: Sequence[str] | None, doc: str, default_on_anomaly: str = "warn") -> argparse.Namespace:
    """The command line every example shares: ``--log-dir`` and ``--on-anomaly``."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help=f"CSVLogger save_dir (default: {DEFAULT_LOG_DIR})")
    parser.add_argument(
        "--on-anomaly",
        choices=ON_ANOMALY,
        default=default_on_anomaly,
        help=f"what the callback does when a rule fires (default: {default_on_anomaly})",
    )
    return parser.parse_args(argv)


def quiet_lightning() -> None:
    """Hide Lightning's advice about tiny runs (no workers, few batches), so the callback's output stands out.

    Only the scripts' ``__main__`` blocks call it: it changes process-wide warning filters.
    """
    for message in (".*does not have many workers.*", ".*The number of training batches.*"):
        warnings.filterwarnings("ignore", message=message)


def command(script: str, module: str) -> str:
    """How to run ``script`` from any shell after the README's set-up, without activating the virtual environment.

    The full path of the console script installed next to this Python (``.venv/bin/hookdiag``), or ``python -m
    <module>`` with this Python's full path where there is no such script.
    """
    installed = Path(sys.executable).parent / script
    if installed.exists():
        return shlex.quote(str(installed))
    return f"{shlex.quote(sys.executable)} -m {module}"


def describe(callback: LayerHealthCallback, csv_dir: Path, name: str, stat: str, tb_dir: Path | None = None) -> None:
    """Print the alerts, the findings of the last sampled step, where the logs are and the commands to read them.

    Every finding is printed once: the last step's findings that were already alerted are not repeated.
    """
    print(f"\n== {name}: what LayerHealthCallback found ==")
    if not callback.findings:
        print("no findings: every rule stayed silent on every sampled step")
    else:
        n = len(callback.findings)
        print(f"{n} alert(s) (a rule firing on a layer for the first time, or again after it cleared):")
        for f in callback.findings:
            print(f"  step {f.step:>3}  {f.rule:<19} {f.layer:<14} value={f.value:.3g}  threshold={f.threshold:g}")
            print(f"            {f.message}")
    if callback.last_step is not None:
        alerted = set(callback.findings)
        repeated = sum(1 for f in callback.last_findings if f in alerted)
        others = [f for f in callback.last_findings if f not in alerted]
        print(f"findings of the last sampled step ({callback.last_step}): {len(callback.last_findings)}", end="")
        print(f" ({repeated} of them listed above)" if repeated else "")
        for f in others:
            print(f"  step {f.step:>3}  {f.rule:<19} {f.layer:<14} {f.message}")
    print(f"\nlayers in forward order: {', '.join(callback.execution_order)}")
    print(f"CSV log: {csv_dir / 'metrics.csv'}")
    print("draw a heatmap of one statistic (layers in forward order x sampled steps):")
    print(f"  {command('hookdiag', 'lightning_hookdiag')} report {csv_dir} --stat {stat}")
    if tb_dir is not None:
        print("open the run in TensorBoard:")
        print(f"  {command('tensorboard', 'tensorboard.main')} --logdir {tb_dir}")


def exit_code(callback: LayerHealthCallback) -> int:
    """1 when training stopped on a :class:`~lightning_hookdiag.LayerHealthError`, else 0: for a script's exit status.

    With ``on_anomaly="raise"`` the error is raised on the first step with a finding, so a finding of the last
    sampled step means the run was stopped by it.
    """
    return 1 if callback.on_anomaly == "raise" and callback.last_findings else 0


def run(
    module: pl.LightningModule,
    data: TensorDataset,
    callback: LayerHealthCallback,
    *,
    log_dir: str | Path,
    name: str,
    max_steps: int,
    batch_size: int = 64,
    stat: str = "act_grad_norm",
    extra_loggers: Sequence[Logger] = (),
) -> LayerHealthCallback:
    """Train ``module`` on ``data`` for ``max_steps`` optimizer steps with ``callback``, a CSVLogger and TensorBoard.

    Logs go to ``<log_dir>/<name>/version_<n>`` (CSV) and ``<log_dir>/<name>_tb/version_<n>`` (TensorBoard, when
    ``tensorboard`` is installed: ``pip install -e ".[examples]"``), and to every logger in ``extra_loggers``. What
    the callback found is printed also when training ends with an exception (``on_anomaly="raise"``), which then
    propagates.

    Returns:
        ``callback``, with its ``findings``, ``last_findings`` and ``last_metrics`` filled in.
    """
    logger = CSVLogger(str(log_dir), name=name)
    loggers: list[Logger] = [logger]
    tensorboard = None
    if importlib.util.find_spec("tensorboard") is not None:
        tensorboard = TensorBoardLogger(str(log_dir), name=f"{name}_tb")
        loggers.append(tensorboard)
    loggers.extend(extra_loggers)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=loggers,
        callbacks=[callback],
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    # shuffle=False and no workers: the run is the same every time (each example seeds torch before building).
    loader = DataLoader(data, batch_size=batch_size, shuffle=False)
    csv_dir = Path(logger.log_dir).resolve()
    # Layers this small gain nothing from intra-op threads, and on a busy machine the threads' hand-offs make a
    # run several times slower; the previous setting is restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.fit(module, loader)
    finally:
        torch.set_num_threads(threads)
        tb_dir = Path(tensorboard.log_dir).resolve() if tensorboard is not None else None
        describe(callback, csv_dir, name, stat, tb_dir)
    return callback
