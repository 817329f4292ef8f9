"""Run by test_callback_ddp.py in a subprocess: real Lightning DDP on CPU (gloo), 2 processes.

Lightning's ``ddp`` strategy re-executes this script for rank 1, so everything happens under ``__main__``. Each
rank saves what it recorded (inputs and weights per batch), the callback's pooled values per sampled step, and how
many ``torch.distributed`` collectives the callback issued while finishing each sampled step.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for the helpers package

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
    import torch.distributed as dist
    from helpers import TinyModule, make_trainer
    from torch import nn
    from torch.utils.data import TensorDataset

    from lightning_hookdiag import OPT_IN_STATS, PRECURSOR_STATS, LayerHealthCallback

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
    # "opt_in": depth 1 again, with every opt-in statistic (pooled over processes like the rest).
    for depth in (1, 6, "opt_in"):
        opt_in = depth == "opt_in"
        depth = 1 if opt_in else depth
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        width = 8
        for i in range(depth):
            layers += [nn.Linear(4 if i == 0 else width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 1))
        module = PerRankData(model=model, lr=0.01)
        callback = (
            CountingCallback(
                every_n_steps=2,
                stats=[*OPT_IN_STATS, *PRECURSOR_STATS],
                measure={"precision_targets": ["float16", "float8_e5m2"]},
            )
            if opt_in
            else CountingCallback(
                every_n_steps=2, output={"charts": "all"}
            )  # every statistic is compared with a reference
        )
        trainer = make_trainer(
            [callback],
            max_steps=5,
            devices=2,
            strategy="ddp",
            accumulate_grad_batches=2,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        results["opt_in" if opt_in else depth] = {
            "record": module.record,
            "pooled": callback.pooled,
            "collectives": callback.collectives,
            "final": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
            "findings": [f.rule for f in callback.findings],
        }
    results["branch"] = branch_run(CountingCallback)
    results["diverge"] = diverge_run(CountingCallback)
    torch.save(results, os.path.join(out_dir, f"rank{int(os.environ.get('LOCAL_RANK', 0))}.pt"))


def branch_run(callback_class: type) -> dict:
    """A ReLU branch (6 units, beside an 8-unit trunk ReLU) that runs on rank 1 only on step 0, then on both ranks.

    Returns the pooled values per sampled step and the branch ReLU's outputs this rank saw, per step.
    """
    import lightning.pytorch as pl
    from helpers import make_data, make_trainer
    from torch import nn
    from torch.utils.data import DataLoader

    class Branchy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.branch = nn.Sequential(nn.Linear(8, 6), nn.ReLU())
            self.head = nn.Linear(8, 1)
            self.branch_head = nn.Linear(6, 1)
            self.seen: dict[int, list[torch.Tensor]] = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.trunk(x)
            out = self.head(h)
            if self.global_rank == 1 or self.global_step > 0:
                b = self.branch(h)
                self.seen.setdefault(self.global_step, []).append(b.detach().clone())
                out = out + self.branch_head(b)
            else:
                # The branch's parameters take part in the gradient all-reduce without the branch running.
                out = out + 0.0 * sum(p.sum() for p in [*self.branch.parameters(), *self.branch_head.parameters()])
            return nn.functional.mse_loss(out, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = make_data(16, seed=self.global_rank)
            return DataLoader(data, batch_size=4)

    module = Branchy()
    callback = callback_class(every_n_steps=2, output={"summary": False}, on_anomaly="ignore")
    trainer = make_trainer([callback], max_steps=4, devices=2, strategy="ddp", use_distributed_sampler=False)
    trainer.fit(module)
    return {
        "pooled": callback.pooled,
        "collectives": callback.collectives,
        "seen": module.seen,
        "global_step": trainer.global_step,
    }


def diverge_run(callback_class: type) -> dict:
    """Rank 1 adds 0.5 to one weight of ``model.0`` after step 1's optimizer step; the twin run leaves it alone.

    Returns, per run, the findings, the pooled values and collectives per sampled step, and the weights each batch
    saw on this rank.
    """
    import lightning.pytorch as pl
    from helpers import TinyModule, make_trainer

    class Perturb(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and pl_module.global_rank == 1:  # step 1's optimizer has stepped
                with torch.no_grad():
                    pl_module.model[0].weight[0, 0] += 0.5

    out = {}
    for perturbed in (False, True):
        torch.manual_seed(0)
        module = TinyModule(lr=0.01)
        callback = callback_class(every_n_steps=2, output={"summary": False}, on_anomaly="ignore")
        extra = [Perturb()] if perturbed else []
        make_trainer([callback, *extra], max_steps=5, devices=2, strategy="ddp").fit(module)
        out["perturbed" if perturbed else "healthy"] = {
            "findings": [vars(f) for f in callback.findings],
            "pooled": callback.pooled,
            "collectives": callback.collectives,
            "record": {step: weights for step, _, _, weights in module.record},
        }
    return out


if __name__ == "__main__":
    main(sys.argv[1])
