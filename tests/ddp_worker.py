"""Run by tests/test_ddp.py in a subprocess: real Lightning DDP on CPU (gloo), 2 processes.

Lightning's ``ddp`` strategy re-executes this script for rank 1, so everything happens under ``__main__``. Each
rank saves what it recorded (inputs and weights per batch), the callback's pooled values per sampled step, and how
many ``torch.distributed`` collectives the callback issued while finishing each sampled step.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
    "barrier",
)


def main(out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from conftest import TinyModule
    from torch import nn
    from torch.utils.data import TensorDataset

    from lightning_hookdiag import LayerHealthCallback

    counting = {"active": False, "calls": 0}
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            if counting["active"]:
                counting["calls"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)

    class CountingCallback(LayerHealthCallback):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.pooled: dict[int, dict[str, float]] = {}
            self.collectives: dict[int, int] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            before = self.last_step
            counting["active"], counting["calls"] = True, 0
            try:
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            finally:
                counting["active"] = False
            if self.last_step != before:
                self.pooled[self.last_step] = dict(self.last_metrics)
                self.collectives[self.last_step] = counting["calls"]

    class PerRankData(TinyModule):
        # Each process gets a very different distribution (rank 1: 10x the spread, shifted), so one process's
        # statistics alone would be far from those of the union.
        def train_dataloader(self):
            g = torch.Generator().manual_seed(self.global_rank)
            x = torch.randn(32, 4, generator=g) * (1 + 9 * self.global_rank) + 3 * self.global_rank
            y = torch.randn(32, 1, generator=g)
            return torch.utils.data.DataLoader(TensorDataset(x, y), batch_size=4)

    results = {}
    for depth in (1, 6):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        width = 8
        for i in range(depth):
            layers += [nn.Linear(4 if i == 0 else width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 1))
        module = PerRankData(model=model, lr=0.01)
        callback = CountingCallback(every_n_steps=2)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_steps=5,
            accumulate_grad_batches=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            callbacks=[callback],
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        results[depth] = {
            "record": module.record,
            "pooled": callback.pooled,
            "collectives": callback.collectives,
            "final": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
        }
    torch.save(results, os.path.join(out_dir, f"rank{int(os.environ.get('LOCAL_RANK', 0))}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
