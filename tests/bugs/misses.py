"""The misses of the held-out bug sets (issue 28, items 1-6), each a small real Lightning fit with its fixed twin.

Kept apart from ``cases.py`` so that each round of held-out bugs is one self-contained file; ``cases.py`` appends
:data:`MISSES` to its ``CASES``.
"""

from __future__ import annotations

from typing import Any

import torch
from cases import BOOKKEEPING, DATA, NUMERICAL, P3, P6, BugModule, Case, Fit, ManualBug, _data, _mlp
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_hookdiag._vocabulary import ALL_STATS, OUTPUT_LAYER_STATS

__all__ = ["MISSES"]


# --- 1. a per-step warm-up stepped per epoch ----------------------------------------------------------------------
class _WarmupModule(BugModule):
    """Adam with a linear warm-up over 1000 steps (``LambdaLR``); ``per_step``: the fix, ``"interval": "step"``."""

    def __init__(self, per_step: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.per_step = per_step

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 1000))
        # The bug: without "interval": "step" Lightning steps the scheduler once per epoch, so the lr stays at
        # lr / 1000 for the whole first epoch.
        scheduler = {"scheduler": warmup, "interval": "step"} if self.per_step else warmup
        return {"optimizer": opt, "lr_scheduler": scheduler}


def _warmup_per_epoch(sick: bool) -> Fit:
    return Fit(_WarmupModule(per_step=not sick, model=_mlp(), data=_data(8 * 200, 8), lr=1e-3))


# --- 2. gradients zeroed between backward and step ----------------------------------------------------------------
class _ZeroAfterBackward(ManualBug):
    """Manual optimization; ``sick``: ``zero_grad()`` between ``manual_backward`` and ``step`` (a reordering slip)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        opt = self.optimizers()
        loss = self.compute_loss(batch, batch_idx)
        if not self.sick:
            opt.zero_grad()
        self.manual_backward(loss)
        if self.sick:
            opt.zero_grad()  # the bug: the gradients just computed are thrown away before the step
        opt.step()
        return loss.detach()


def _grads_zeroed_before_step(sick: bool) -> Fit:
    return Fit(_ZeroAfterBackward(sick, model=_mlp(), data=_data(64, 8), lr=0.01))


# --- 3. a non-finite batch ----------------------------------------------------------------------------------------
def _standardised(x: Tensor, eps: float) -> Tensor:
    return (x - x.mean(0)) / (x.std(0) + eps)


def _nonfinite_batch(sick: bool) -> Fit:
    # Feature 3 is a constant (a sensor that never changed): its std is 0, and (x - mean) / std is 0 / 0 = NaN for
    # every sample. The fix adds an epsilon to the std.
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(64, 8, generator=g) * 3 + 5
    raw[:, 3] = 7.0
    y = raw[:, :1] - 5
    return Fit(BugModule(_mlp(), TensorDataset(_standardised(raw, 0.0 if sick else 1e-6), y), lr=0.01))


# --- 4. weights broken by the optimizer step ----------------------------------------------------------------------
class _AdamEps(BugModule):
    """Adam with the given ``eps``."""

    def __init__(self, eps: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eps = eps

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, eps=self.eps)


def _fp16_adam_eps(sick: bool) -> Fit:
    # precision="16-true" makes the weights, and Adam's state, float16: eps=1e-8 is below float16's smallest
    # subnormal (6e-8) and rounds to 0, so an entry whose squared gradient underflows divides 0 by 0 (or m by 0).
    # The fix: an eps float16 holds (1e-4).
    module = _AdamEps(1e-8 if sick else 1e-4, model=_mlp(8, 16), data=_data(64, 8), lr=1e-3, optimizer="adam")
    return Fit(module, {"precision": "16-true"})


# --- 5. a loss unbounded below ------------------------------------------------------------------------------------
class _Segmenter(nn.Module):
    """A per-pixel classifier of 8x8 single-channel images: two 1x1 convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 1), nn.ReLU())
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def _uint8_masks(sick: bool) -> Fit:
    # Binary masks stored as uint8 0/255 (as PNG files hold them) go into BCEWithLogits as targets: the loss
    # -255 * logit + log(1 + e**logit) has no minimum, it falls through 0 as the logits of the masked pixels grow. The
    # fix divides the masks by 255.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 8, 8, generator=g)
    masks = (x > 0.3).to(torch.uint8) * 255
    target = masks.float() if sick else masks.float() / 255.0

    def loss(module: BugModule, batch: Any) -> Tensor:
        images, t = batch
        return F.binary_cross_entropy_with_logits(module(images), t)

    return Fit(BugModule(_Segmenter(), TensorDataset(x, target), loss=loss, lr=1e-2, optimizer="adam"))


# --- 6. a harder batch in a fast descent (the twin) against wrong labels (the bug) ------------------------------
def _hard_batch_or_wrong_labels(sick: bool) -> Fit:
    # A classifier descends fast to losses near 2e-5; at step 80 one batch is either harder (its samples moved
    # towards the other classes: a healthy 40x rise, far below where the run started) or has its labels shifted by
    # one (a misaligned join: a real spike).
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 8, generator=g).repeat(120, 1)
    y = torch.arange(8).repeat(120)
    centre = x[:8].mean(0)

    def batch_fn(i: int, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        if i != 80:
            return x, y
        return (x, (y + 1) % 8) if sick else (0.72 * x + 0.28 * centre, y)

    return Fit(
        BugModule(_mlp(8, 32, d_out=8), TensorDataset(x, y), loss="ce", lr=0.014, optimizer="adam", batch_fn=batch_fn)
    )


MISSES: tuple[Case, ...] = (
    Case(
        "warmup_per_epoch",
        'a LambdaLR warm-up over 1000 steps returned without `"interval": "step"`: Lightning steps it per epoch,'
        " the lr stays at lr/1000",
        _warmup_per_epoch,
        "warmup_stuck",
        "model.0",
        max_steps=60,
        default_step=50,
        principle=P6,
    ),
    Case(
        "grads_zeroed_before_step",
        "manual optimization: `manual_backward(loss); opt.zero_grad(); opt.step()`",
        _grads_zeroed_before_step,
        "zeroed_gradients",
        "model.0",
        max_steps=4,
        step=0,
        default_step=0,
        principle=BOOKKEEPING,
    ),
    Case(
        "nonfinite_batch",
        "inputs standardised by a per-feature std that is 0 for a constant feature: every batch is NaN",
        _nonfinite_batch,
        "nonfinite",
        "<batch>",
        max_steps=3,
        step=0,
        default_step=0,
        principle=NUMERICAL,
    ),
    Case(
        "fp16_adam_eps",
        "`precision='16-true'` with Adam(eps=1e-8): eps rounds to 0 in float16, the first update writes NaN/Inf"
        " (the twin: eps=1e-4)",
        _fp16_adam_eps,
        "nonfinite",
        "model.0",
        max_steps=4,
        step=0,
        default_step=0,
        principle=NUMERICAL,
    ),
    Case(
        "uint8_masks",
        "BCEWithLogits on uint8 0/255 masks: the loss has no minimum and falls through 0",
        _uint8_masks,
        "unbounded_loss",
        "model.head",
        max_steps=60,
        callback={"stats": [*ALL_STATS, *OUTPUT_LAYER_STATS]},  # the output layer's statistics
        default_note="unbounded_loss needs 8 sampled steps of a falling negative loss and a growing head (about"
        " 350 steps at every_n_steps=50); the every-step loss falls smoothly through zero (no spike, no NaN), so the"
        " sentinel has nothing to trip on, and a loss below zero is not a fault in general (likelihoods)",
        principle=P3,
    ),
    Case(
        "hard_batch_vs_wrong_labels",
        "a classifier in fast descent (loss ~2e-5) gets a batch with shifted labels at step 80; the twin gets a"
        " harder batch (a 40x rise to ~1e-3)",
        _hard_batch_or_wrong_labels,
        "loss_spike",
        "loss",
        max_steps=82,
        callback={"every_n_steps": 50},
        step=80,
        default_step=80,
        principle=DATA,
    ),
)
"""The held-out misses, in the order of issue 28."""
