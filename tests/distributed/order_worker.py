"""Run by test_callback_ddp_order.py in a subprocess: real Lightning DDP on CPU (gloo), 2 processes.

A layer ``rare`` runs on rank 1 only, between the trunk and the head, and makes a NaN on step 2. Each rank saves the
callback's values, forward order and findings per sampled step.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for the helpers package


def main(out_dir: str) -> None:
    import lightning.pytorch as pl
    from helpers import make_data, make_trainer
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_hookdiag import LayerHealthCallback

    class Rare(nn.Module):
        """A leaf with its own weight; ``poison`` makes its output NaN."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))
            self.poison = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x * self.weight
            return out * float("nan") if self.poison else out

    class OneRankBranch(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.head = nn.Linear(8, 1)
            self.rare = Rare()  # registered after head: selection order differs from forward order

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.trunk(x)
            if self.global_rank == 1:
                self.rare.poison = self.global_step == 2
                h = self.rare(h)
            return nn.functional.mse_loss(self.head(h), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(make_data(16, seed=self.global_rank), batch_size=4)

    class Keeping(LayerHealthCallback):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.kept: dict[int, dict] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            before = self.last_step
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if self.last_step != before:
                self.kept[self.last_step] = {
                    "metrics": dict(self.last_metrics),
                    "order": list(self.execution_order),
                    "findings": [(f.rule, f.layer, f.stat) for f in self.last_findings],
                }

    callback = Keeping(every_n_steps=2, output={"summary": False}, on_anomaly="ignore", sentinel=None)
    trainer = make_trainer(
        [callback], max_steps=3, devices=2, strategy="ddp_find_unused_parameters_true", use_distributed_sampler=False
    )
    trainer.fit(OneRankBranch())
    torch.save(callback.kept, os.path.join(out_dir, f"rank{int(os.environ.get('LOCAL_RANK', 0))}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
