"""The spike test's scale is where the run started: a loss that collapsed within its first steps (issue 35, item 10).

A classifier on easy blobs falls four decades in 20 steps. A harder batch then gives 100x the recent losses, but far
below where the run started: no spike. A batch with every label wrong in the same run is one, from the targets.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TinyModule, make_trainer
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import TensorDataset

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.rules import LOSS

pytestmark = pytest.mark.slow

BATCH, STEPS, CLASSES = 32, 40, 5
HARD, WRONG = 21, 37


class LossLog(Callback):
    """Every optimizer step's training loss (one micro-batch per step here)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_before_backward(self, trainer, pl_module, loss):
        self.losses.append(loss.item())


class Blobs(TinyModule):
    """Cross-entropy on 5 well separated blobs; step HARD's batch lies a quarter of the way towards the next class,
    step WRONG's labels are all shifted by one class. ``first``: the step whose batch the dataset starts with (the rest
    follow, then the earlier ones)."""

    def __init__(self, first: int = 0) -> None:
        g = torch.Generator().manual_seed(1)
        n, d = BATCH * STEPS, 8
        centers = torch.randn(CLASSES, d, generator=g) * 20
        y = torch.randint(0, CLASSES, (n,), generator=g)
        x = centers[y] + torch.randn(n, d, generator=g)
        hard = slice(HARD * BATCH, (HARD + 1) * BATCH)
        between = 0.75 * centers[y[hard]] + 0.25 * centers[(y[hard] + 1) % CLASSES]
        x[hard] = between + torch.randn(BATCH, d, generator=g)
        wrong = slice(WRONG * BATCH, (WRONG + 1) * BATCH)
        y[wrong] = (y[wrong] + 1) % CLASSES
        model = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        x, y = x.roll(-first * BATCH, 0), y.roll(-first * BATCH, 0)
        super().__init__(model=model, data=TensorDataset(x, y), batch_size=BATCH, lr=1e-2, optimizer="adam")
        self.record_enabled = False

    def loss(self, out, y):
        return nn.functional.cross_entropy(out, y)


def _median_low(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _check_the_case(losses: list[float], callback: LayerHealthCallback) -> None:
    # The case as the issue describes it: the loss collapsed by steps 10-20, and the hard batch is far above the
    # recent losses (more than the spike ratio of 10) but a tiny share of where the run started.
    assert losses[0] > 1.0
    assert max(losses[10:HARD]) < 2e-3
    recent = _median_low(losses[HARD - 5 : HARD])
    assert losses[HARD] / recent > 40
    assert losses[HARD] / _median_low(losses[:3]) < 1e-2
    # The median of the first 20 losses is itself inside the collapse: a floor at 1 % of it lets the hard batch trip.
    assert losses[HARD] > 1e-2 * _median_low(losses[:20])
    assert losses[WRONG] > losses[0]

    assert [(t.step, t.kind) for t in callback.trips] == [(WRONG, "loss_spike")]
    spikes = [f for f in callback.findings if f.rule == "loss_spike"]
    assert [(f.step, f.layer, f.stat) for f in spikes] == [(WRONG, LOSS, "loss")]
    assert "comes from the targets or the loss, not from the network" in spikes[0].message


def test_a_harder_batch_after_a_fast_collapse_is_no_spike_and_wrong_labels_are():
    torch.manual_seed(0)
    losses = LossLog()
    callback = LayerHealthCallback(on_anomaly="ignore", output={"summary": False})
    make_trainer([callback, losses], max_steps=STEPS).fit(Blobs())
    _check_the_case(losses.losses, callback)


def test_the_start_scale_survives_a_checkpoint_after_the_early_steps_left_the_window(tmp_path):
    # A window of 10: when training resumes at step 15, the restored window holds steps 5-14 only, all collapsed.
    # The dataloader is not resumable: Lightning resumes the epoch at batch 15 with the loader started over, so the
    # resumed fit's dataset starts with step 15's batch.
    sentinel = {"window": 10, "warmup": 10}
    torch.manual_seed(0)
    first = LayerHealthCallback(on_anomaly="ignore", sentinel=sentinel, output={"summary": False})
    trainer = make_trainer([first, LossLog()], max_steps=15)
    trainer.fit(Blobs())
    path = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(path)

    resumed = LayerHealthCallback(on_anomaly="ignore", sentinel=sentinel, output={"summary": False})
    losses = LossLog()
    make_trainer([resumed, losses], max_steps=STEPS).fit(Blobs(first=15), ckpt_path=path)
    assert len(losses.losses) == STEPS - 15
    assert losses.losses[HARD - 15] / _median_low(losses.losses[HARD - 20 : HARD - 15]) > 40
    assert [(t.step, t.kind) for t in resumed.trips] == [(WRONG, "loss_spike")]
