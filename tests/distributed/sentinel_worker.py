"""Run by test_sentinel_distributed.py: the sentinel under real 2-process Lightning training on CPU (gloo).

``python sentinel_worker.py OUT ddp``: DDP, rank 1 alone produces a NaN in one module on step 3; both ranks trip,
replay together, and pool the replayed statistics. ``... OUT model_parallel``: FSDP2 (Lightning's
``ModelParallelStrategy``), rank 1's loss is NaN on step 1; a sharded step is not replayed, and nothing hangs.
Lightning re-executes this script for rank 1. Each rank saves its trips, findings, logged values per step and the
collectives the callback issued in ``on_before_optimizer_step`` per step.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for the helpers package

SICK_STEP = 3


def main(out_dir: str, mode: str) -> None:
    import lightning.pytorch as pl
    from fsdp_worker import count_collectives, counted
    from helpers import RecordingLogger, make_trainer
    from helpers.cost import count_host_transfers
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hookdiag import LayerHealthCallback

    count_collectives()

    class Recording(LayerHealthCallback):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.collectives: dict[int, int] = {}
            self.reads: dict[int, int] = {}  # host transfers (Tensor.tolist, .item, ...) in the sentinel's hook

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            transfers = {"active": True, "calls": 0}
            with counted() as count, count_host_transfers(transfers):
                super().on_before_optimizer_step(trainer, pl_module, optimizer)
            self.collectives[trainer.global_step] = count["calls"]
            self.reads[trainer.global_step] = transfers["calls"]

    class NaNOnRank1(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = -1
            self.rank = 0

        def forward(self, x):
            return x * float("nan") if (self.rank, self.step) == (1, SICK_STEP) else x

    if mode == "ddp":

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.model = nn.Sequential(
                    nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), NaNOnRank1(), nn.ReLU(), nn.Linear(16, 1)
                )

            def training_step(self, batch, batch_idx):
                self.model[3].step, self.model[3].rank = self.global_step, self.global_rank
                x, y = batch
                return nn.functional.mse_loss(self.model(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)

            def train_dataloader(self):
                g = torch.Generator().manual_seed(self.global_rank)
                x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
                return DataLoader(TensorDataset(x, y), batch_size=4)

        strategy: Any = "ddp"
        max_steps = SICK_STEP + 1
    else:
        from fsdp_worker import BATCH, batch, make_model, shard
        from lightning.pytorch.strategies import ModelParallelStrategy

        class Module(pl.LightningModule):  # type: ignore[no-redef]
            def __init__(self) -> None:
                super().__init__()
                self.model = make_model(1)

            def configure_model(self) -> None:
                shard(self.model, self.device_mesh["data_parallel"])

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = nn.functional.mse_loss(self.model(x), y)
                return loss * float("nan") if (self.global_rank, self.global_step) == (1, 1) else loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)

            def train_dataloader(self):
                xs, ys = zip(*(batch(self.global_rank, step) for step in range(4)), strict=True)
                return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=BATCH)

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        max_steps = 3

    callback = Recording(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    logger = RecordingLogger()  # its log_metrics is not rank-zero-only: every rank records what it logged
    trainer = make_trainer(
        [callback], max_steps=max_steps, devices=2, strategy=strategy, use_distributed_sampler=False, logger=[logger]
    )
    trainer.fit(Module())
    torch.save(
        {
            "trips": [vars(t) for t in callback.trips],
            "findings": [vars(f) for f in callback.findings],
            "logged": dict(logger.ours()),
            "collectives": callback.collectives,
            "reads": callback.reads,
        },
        os.path.join(out_dir, f"{mode}_rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
