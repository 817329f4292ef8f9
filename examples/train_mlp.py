"""Main example: train a small MLP on synthetic data with LayerHealthCallback, logging to CSV and TensorBoard.

Run from the repository root:

    python examples/train_mlp.py

It prints where the logs are and how to look at them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
from _common import command
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback


class SpiralClassifier(pl.LightningModule):
    """A 4-layer ReLU MLP that learns to separate three interleaved spirals."""

    def __init__(self, width: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = nn.Sequential(
            nn.Linear(2, width),
            nn.ReLU(inplace=True),
            nn.Linear(width, width),
            nn.ReLU(inplace=True),
            nn.Linear(width, width),
            nn.ReLU(inplace=True),
            nn.Linear(width, 3),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def spirals(n: int = 3000, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 3, (n,), generator=g)
    r = torch.rand(n, generator=g)
    angle = 4 * r + label * (2 * torch.pi / 3) + 0.2 * torch.randn(n, generator=g)
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)
    return TensorDataset(x, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="hookdiag_logs", help="where CSV and TensorBoard logs go")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    loader = DataLoader(spirals(), batch_size=64, shuffle=True)
    csv_logger = CSVLogger(args.log_dir, name="spirals")
    tb_logger = TensorBoardLogger(args.log_dir, name="spirals_tb")
    health = LayerHealthCallback(every_n_steps=10)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=[csv_logger, tb_logger],
        callbacks=[health],
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(SpiralClassifier(), loader)

    csv_dir = Path(csv_logger.log_dir).resolve()
    tb_dir = Path(tb_logger.log_dir).resolve()
    print()
    print(f"Sampled optimizer step {health.last_step}: {len(health.last_metrics)} layer_health values, e.g.")
    for key in sorted(health.last_metrics)[:6]:
        print(f"  {key} = {health.last_metrics[key]:.4g}")
    print()
    print(f"CSV log:          {csv_dir / 'metrics.csv'}")
    print(f"TensorBoard logs: {tb_dir}")
    print("Look at them with:")
    print(f"  {command('hookdiag', 'lightning_hookdiag')} report {csv_dir} --stat act_grad_norm")
    print(f"  {command('tensorboard', 'tensorboard.main')} --logdir {tb_dir}")


if __name__ == "__main__":
    main()
