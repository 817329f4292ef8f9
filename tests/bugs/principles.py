"""Ordinary training bugs grouped by the principles of issue 38, each a small real Lightning fit with its fixed twin.

Written as a user would write them (a head swapped in ``on_fit_start``, an auxiliary loss forgotten, a second
``/ 255``), not to fit a rule: a case whose principle no rule checks yet is a known miss (``rule=None``) whose
``blind`` says what the callback reports today, measured, and ``layer`` says where a right diagnosis points.
``cases.py`` appends :data:`PRINCIPLE_CASES` to its ``CASES``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from cases import (
    BOOKKEEPING,
    DATA,
    P1,
    P2,
    P3,
    P4,
    P5,
    P6,
    UPDATES,
    BugModule,
    Case,
    Fit,
    ManualBug,
    _body_head,
    _data,
    _mlp,
)
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

__all__ = ["PRINCIPLE_CASES"]


def _classes(n: int, d_in: int, classes: int, seed: int = 0) -> TensorDataset:
    # A learnable labelling (the sign pattern of two features), so that a healthy fit's loss falls.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    return TensorDataset(x, ((x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()) % classes)


# --- 1. parameters whose life is not accounted for ----------------------------------------------------------------
class _NewHead(BugModule):
    """A pretrained body whose one-output head is replaced by a 4-class head; ``late``: in ``on_fit_start``."""

    def __init__(self, late: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.late = late

    def setup(self, stage: str) -> None:
        if not self.late:  # the fix: setup runs before configure_optimizers
            self.model.head = nn.Linear(16, 4)

    def on_fit_start(self) -> None:
        if self.late:  # the bug: on_fit_start runs after configure_optimizers built the optimizer from the old head
            self.model.head = nn.Linear(16, 4)


def _head_replaced_in_on_fit_start(sick: bool) -> Fit:
    return Fit(_NewHead(sick, model=_body_head(), data=_classes(64, 8, 4), loss="ce", lr=0.1))


class _WithEma(BugModule):
    """A model with an EMA copy for evaluation; ``sick``: the optimizer is built over the copy (a copy-paste slip)."""

    def __init__(self, sick: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ema = copy.deepcopy(self.model).requires_grad_(False)
        self.sick = sick

    def configure_optimizers(self) -> Any:
        params = self.ema.parameters() if self.sick else self.model.parameters()
        return torch.optim.SGD(params, lr=self.lr)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.model.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)


def _optimizer_over_ema_copy(sick: bool) -> Fit:
    return Fit(_WithEma(sick, model=_mlp(), data=_data(64, 8)))


class _StepBeforeBackward(ManualBug):
    """Manual optimization; ``sick``: ``zero_grad(); step(); manual_backward(loss)`` (the step moved up a line)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        opt = self.optimizers()
        loss = self.compute_loss(batch, batch_idx)
        opt.zero_grad()
        if self.sick:
            opt.step()  # the bug: the gradients are still None here; the backward below is cleared next step
            self.manual_backward(loss)
        else:
            self.manual_backward(loss)
            opt.step()
        return loss.detach()


def _step_before_backward(sick: bool) -> Fit:
    return Fit(_StepBeforeBackward(sick, model=_mlp(), data=_data(64, 8), lr=0.01))


class _Unfreeze(BugModule):
    """The body frozen for a one-epoch warm-up, unfrozen at epoch 1; ``typo``: ``p.requires_grad_ = True``."""

    def __init__(self, typo: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.typo = typo
        self.model.body.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch != 1:
            return
        for p in self.model.body.parameters():
            if self.typo:
                p.requires_grad_ = True  # type: ignore[method-assign]  # the bug: sets an attribute, freezes on
            else:
                p.requires_grad = True


def _unfreeze_typo(sick: bool) -> Fit:
    return Fit(_Unfreeze(sick, model=_body_head(), data=_data(64, 8)))


# --- 2. modules whose part in the run changes or never starts -----------------------------------------------------
class _WithAux(nn.Module):
    """A classifier with an auxiliary head on the body (deep supervision)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.body(x)
        return self.head(h), self.aux(h)


def _aux_loss_forgotten(sick: bool) -> Fit:
    def loss(module: BugModule, batch: Any) -> Tensor:
        x, y = batch
        out, aux = module(x)
        main = F.cross_entropy(out, y)
        return main if sick else main + 0.4 * F.cross_entropy(aux, y)  # the bug: the auxiliary loss is never added

    return Fit(BugModule(_WithAux(), _classes(64, 8, 4), loss=loss, lr=0.1))


class _Context(nn.Module):
    """A main path and a context branch added for the first ``warm`` epochs; ``by_step``: compared with the step."""

    def __init__(self, by_step: bool) -> None:
        super().__init__()
        self.main = _mlp()
        self.context = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.by_step = by_step
        self.clock = (0, 0)  # (epoch, step), set by the module before each forward

    def forward(self, x: Tensor) -> Tensor:
        epoch, step = self.clock
        # The bug: `warm_epochs=3` compared with the global step, so the branch stops after step 3, mid-epoch.
        if (step if self.by_step else epoch) < 3:
            return self.main(x) + self.context(x)
        return self.main(x)


def _branch_stops_after_step_3(sick: bool) -> Fit:
    model = _Context(by_step=sick)

    def clock(module: BugModule, batch_idx: int) -> None:
        model.clock = (module.current_epoch, module.global_step)

    return Fit(BugModule(model, _data(64, 8), on_batch=clock))


class _Skip(nn.Module):
    """A residual MLP block with a learned linear skip; ``detach``: the skip's output detached (left from a probe)."""

    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.skip = nn.Linear(8, 1)
        self.detach = detach

    def forward(self, x: Tensor) -> Tensor:
        s = self.skip(x)
        return self.main(x) + (s.detach() if self.detach else s)


def _detached_skip(sick: bool) -> Fit:
    return Fit(BugModule(_Skip(detach=sick), _data(64, 8)))


# --- 3. scale at both ends ----------------------------------------------------------------------------------------
def _pixels_divided_twice(sick: bool) -> Fit:
    # The Dataset already returns pixels in [0, 1] (ToTensor); training_step divides by 255 again: inputs ~0.002.
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (64, 64), generator=g).float() / 255.0
    labels = (pixels[:, :32].mean(1) > pixels[:, 32:].mean(1)).long()

    def batch_fn(i: int, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return (x / 255.0 if sick else x), y

    return Fit(BugModule(_mlp(64, 32, d_out=2), TensorDataset(pixels, labels), loss="ce", lr=0.01, batch_fn=batch_fn))


def _nll_on_raw_logits(sick: bool) -> Fit:
    # nn.NLLLoss on the raw logits (the log_softmax forgotten): the loss is -logit[y], which has no minimum.
    def loss(module: BugModule, batch: Any) -> Tensor:
        x, y = batch
        logits = module(x)
        return F.nll_loss(logits if sick else F.log_softmax(logits, dim=-1), y)

    return Fit(BugModule(_mlp(8, 16, d_out=4), _classes(64, 8, 4), loss=loss, lr=0.01))


# --- 4. a symptom judged by its consequence -----------------------------------------------------------------------
class _Prob(nn.Module):
    """A binary classifier ending in ``nn.Sigmoid``: a confident one (logits of |z| ~ 10 from the start)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        with torch.no_grad():
            self.net[2].weight.mul_(20.0)
        self.prob = nn.Sigmoid()

    def forward(self, x: Tensor) -> Tensor:
        return self.prob(self.net(x))


def _probabilities_into_bce_with_logits(sick: bool) -> Fit:
    # The probabilities go into BCEWithLogitsLoss (a second sigmoid); the twin uses BCELoss, whose derivative cancels
    # the saturated sigmoid's: the same saturated layer, healthy there.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, :1] > 0).float()

    def loss(module: BugModule, batch: Any) -> Tensor:
        p = module(batch[0])
        return F.binary_cross_entropy_with_logits(p, batch[1]) if sick else F.binary_cross_entropy(p, batch[1])

    return Fit(BugModule(_Prob(), TensorDataset(x, y), loss=loss, lr=0.05))


def _softmax_over_the_batch(sick: bool) -> Fit:
    # log_softmax over dim=0 (the batch) where dim=-1 (the classes) was meant: each class is normalised across samples.
    def loss(module: BugModule, batch: Any) -> Tensor:
        x, y = batch
        return F.nll_loss(F.log_softmax(module(x), dim=0 if sick else -1), y)

    return Fit(BugModule(_mlp(8, 16, d_out=4), _classes(64, 8, 4), loss=loss, lr=0.05))


# --- 5. the origin of growth --------------------------------------------------------------------------------------
def _unscaled_init_stack(sick: bool) -> Fit:
    # Every Linear initialised with nn.init.normal_(w) (std 1, no 1/sqrt(fan_in)): each layer of width 32 multiplies
    # the signal by ~4 from the first Linear on. The fix: He init.
    model = _mlp(8, 32, depth=5)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight) if sick else nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    return Fit(BugModule(model, _data(64, 8), lr=1e-3))


# --- 6. the optimizers as a whole ---------------------------------------------------------------------------------
class _TwoOptimizers(ManualBug):
    """Manual optimization with a body and a head optimizer; ``sick``: the head's built from ``self.parameters()``."""

    def configure_optimizers(self) -> Any:
        head = self.parameters() if self.sick else self.model.head.parameters()
        return [torch.optim.SGD(self.model.body.parameters(), lr=self.lr), torch.optim.Adam(head, lr=1e-3)]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        body, head = self.optimizers()
        loss = self.compute_loss(batch, batch_idx)
        body.zero_grad()
        head.zero_grad()
        self.manual_backward(loss)
        body.step()
        head.step()
        return loss.detach()


def _parameters_in_two_optimizers(sick: bool) -> Fit:
    return Fit(_TwoOptimizers(sick, model=_body_head(), data=_data(64, 8)))


class _Gan(ManualBug):
    """A small GAN in manual optimization; ``sick``: the generator's optimizer is built from ``self.parameters()``."""

    def __init__(self, sick: bool, **kwargs: Any) -> None:
        super().__init__(sick, **kwargs)
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def configure_optimizers(self) -> Any:
        g_params = self.parameters() if self.sick else self.model.parameters()
        return [
            torch.optim.Adam(g_params, lr=2e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
        ]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        opt_g, opt_d = self.optimizers()
        real, _ = batch
        fake = self.model(torch.randn(real.shape[0], 4))
        ones = torch.ones(real.shape[0], 1)
        d_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(real), ones
        ) + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), 0 * ones)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()  # sick: also steps the discriminator, towards fooling itself
        return g_loss.detach()


def _gan_generator_optimizer_over_all(sick: bool) -> Fit:
    g = torch.Generator().manual_seed(0)
    real = torch.randn(64, 2, generator=g) * 0.5 + torch.tensor([2.0, -1.0])
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    return Fit(_Gan(sick, model=generator, data=TensorDataset(real, torch.zeros(64))))


class _StepsItself(BugModule):
    """A per-step OneCycle-like decay returned to Lightning; ``sick``: ``training_step`` steps it too."""

    def __init__(self, sick: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sick = sick

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / 100))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch, batch_idx)
        if self.sick:
            self.lr_schedulers().step()  # the bug: a loop habit; Lightning already steps it every step
        return loss


def _scheduler_stepped_twice(sick: bool) -> Fit:
    return Fit(_StepsItself(sick, model=_mlp(), data=_data(64, 8)))


# --- the field's other classes ------------------------------------------------------------------------------------
def _labels_shuffled_apart(sick: bool) -> Fit:
    # "Shuffle the data once" applied to the features and the labels with two different permutations.
    data = _classes(64, 8, 4)
    x, y = data.tensors
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(64, generator=g)
    y = y[torch.randperm(64, generator=g)] if sick else y[perm]
    return Fit(BugModule(_mlp(8, 16, d_out=4), TensorDataset(x[perm], y), loss="ce", lr=0.05))


class _WeightDecay(BugModule):
    """SGD with ``weight_decay``."""

    def __init__(self, decay: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decay = decay

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=self.decay)


def _weight_decay_typo(sick: bool) -> Fit:
    # weight_decay=5e-1, a typo for 5e-4: with momentum 0.9 at lr 0.1 every step shrinks the weights by ~40%.
    return Fit(_WeightDecay(5e-1 if sick else 5e-4, model=_mlp(8, 32, depth=3), data=_data(64, 8), lr=0.1))


class _TwiceBackward(ManualBug):
    """Manual optimization; ``sick``: a debugging ``manual_backward(loss, retain_graph=True)`` left in: .grad is 2x."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        opt = self.optimizers()
        loss = self.compute_loss(batch, batch_idx)
        opt.zero_grad()
        if self.sick:
            self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss)
        opt.step()
        return loss.detach()


def _backward_twice(sick: bool) -> Fit:
    return Fit(_TwiceBackward(sick, model=_mlp(), data=_data(64, 8), lr=0.01))


PRINCIPLE_CASES: tuple[Case, ...] = (
    # --- 1. parameter life
    Case(
        "head_replaced_in_on_fit_start",
        "a 4-class head replaces the pretrained one in `on_fit_start`, after `configure_optimizers` built the"
        " optimizer from the old head: the new head gets gradients and never changes",
        _head_replaced_in_on_fit_start,
        "not_updated",
        "model.head",
        max_steps=4,
        step=0,
        default_step=0,
        principle=P1,
    ),
    Case(
        "optimizer_over_ema_copy",
        "`configure_optimizers` built from `self.ema.parameters()` (the EMA copy) instead of the model's:"
        " the model gets gradients and never changes",
        _optimizer_over_ema_copy,
        "not_updated",
        "model.0",
        max_steps=4,
        step=0,
        default_step=0,
        principle=P1,
    ),
    Case(
        "step_before_backward",
        "manual optimization: `opt.zero_grad(); opt.step(); manual_backward(loss)` (the step moved above the"
        " backward): every step applies no gradient",
        _step_before_backward,
        "zeroed_gradients",
        "model.0",
        max_steps=4,
        step=0,
        default_step=0,
        principle=P1,
    ),
    Case(
        "unfreeze_typo",
        "a body frozen for a one-epoch linear-probe warm-up is 'unfrozen' with `p.requires_grad_ = True` (sets"
        " an attribute): it stays frozen, in the optimizer, for the whole run",
        _unfreeze_typo,
        "shadowed_method",
        "model.body.0",
        max_steps=16,
        step=8,  # the first step of epoch 1, where the typo runs
        default_step=50,
        principle=P1,
    ),
    # --- 2. a module's part in the run
    Case(
        "aux_loss_forgotten",
        "an auxiliary head (deep supervision) runs every step but its loss is never added: `model.aux` is in"
        " the optimizer and never gets a gradient",
        _aux_loss_forgotten,
        "output_unused",
        "model.aux",
        max_steps=8,
        step=0,
        default_step=0,
        principle=P2,
    ),
    Case(
        "branch_stops_after_step_3",
        "a context branch meant for the first 3 epochs is gated on the global step: it stops running after"
        " step 3, mid-epoch",
        _branch_stops_after_step_3,
        "stopped_running",
        "model.context.0",
        max_steps=8,
        step=5,  # ran on sampled steps 0-2, then on none of 3-5
        default_note="stopped_running needs a layer to run on each of 3 sampled steps and then on none of 3 more (a"
        " layer skipped now and then, LayerDrop, is not a stop): at every_n_steps=50 that is step 250 at the"
        " earliest, and here the branch ran on sampled step 0 only; the every-step loss shows nothing (the branch"
        " only adds to the output)",
        principle=P2,
    ),
    Case(
        "detached_skip",
        "a learned skip connection's output `.detach()`-ed (left from a probe): the skip never trains",
        _detached_skip,
        "no_gradient",
        "model.skip",
        max_steps=4,
        step=0,
        default_step=0,
        principle=P2,
    ),
    # --- 3. scale at both ends
    Case(
        "pixels_divided_twice",
        "the Dataset already returns pixels in [0, 1] and `training_step` divides by 255 again: inputs ~0.002",
        _pixels_divided_twice,
        "input_scale",
        "model.0",
        max_steps=3,
        step=0,
        default_step=0,
        principle=P3,
    ),
    Case(
        "nll_on_raw_logits",
        "`NLLLoss` on the raw logits (the `log_softmax` forgotten): the loss -logit[y] has no minimum",
        _nll_on_raw_logits,
        "loss_below_floor",
        "model.4",  # the output layer of _mlp(8, 16, d_out=4)
        max_steps=60,
        step=21,  # the first step its loss is below 0 (0.23 at step 0)
        default_step=50,
        principle=P3,
    ),
    # --- 4. a symptom judged by its consequence
    Case(
        "probabilities_into_bce_with_logits",
        "a confident binary classifier ending in nn.Sigmoid feeds BCEWithLogitsLoss (a second sigmoid); the twin"
        " feeds the same saturated Sigmoid to BCELoss, whose derivative cancels it",
        _probabilities_into_bce_with_logits,
        "squashed_twice",
        "model.prob",
        max_steps=8,
        step=0,
        default_step=0,
        principle=P4,
    ),
    Case(
        "softmax_over_the_batch",
        "`log_softmax(logits, dim=0)`: each class normalised over the batch instead of over the classes",
        _softmax_over_the_batch,
        "wrong_softmax_dim",
        "model.4",  # the output layer of _mlp(8, 16, d_out=4): model.2 is the hidden Linear
        max_steps=8,
        step=0,
        default_step=0,
        principle=P4,
    ),
    # --- 5. the origin of growth
    Case(
        "unscaled_init_stack",
        "every Linear of a 6-layer ReLU stack initialised with `nn.init.normal_(w)` (std 1, no 1/sqrt(fan_in)):"
        " the growth starts at the first Linear",
        _unscaled_init_stack,
        "exploding_gradient",
        "model.0",
        max_steps=8,
        step=0,
        default_step=0,
        principle=P5,
    ),
    # --- 6. the optimizers as a whole
    Case(
        "parameters_in_two_optimizers",
        "manual optimization with a body SGD and a head Adam, the head's built from `self.parameters()`: the"
        " body is stepped twice a step",
        _parameters_in_two_optimizers,
        "shared_parameters",
        "model.body.0",
        max_steps=4,
        step=0,
        default_step=0,
        principle=P6,
    ),
    Case(
        "gan_generator_optimizer_over_all",
        "a GAN whose generator optimizer is built from `self.parameters()`: the generator's step also moves the"
        " discriminator, towards being fooled",
        _gan_generator_optimizer_over_all,
        "shared_parameters",
        "discriminator.0",
        max_steps=4,
        step=0,
        default_step=0,
        principle=P6,
    ),
    Case(
        "scheduler_stepped_twice",
        "a per-step LR decay returned to Lightning with `interval: step`, and `self.lr_schedulers().step()` in"
        " `training_step` as well: it decays twice as fast",
        _scheduler_stepped_twice,
        "scheduler_overstepped",
        "model.0",
        max_steps=4,
        step=1,
        default_step=50,
        principle=P6,
    ),
    # --- the field's other classes
    Case(
        "labels_shuffled_apart",
        "features and labels 'shuffled once' with two different permutations: every label belongs to another sample",
        _labels_shuffled_apart,
        None,
        None,
        max_steps=8,
        principle=DATA,
        blind="nothing, and no layer to name: the fit is numerically healthy, only the labels are noise (the"
        " loss 1.48 -> 1.27 over 60 steps, memorising; the twin 1.50 -> 1.22); a monitor of activations,"
        " gradients and parameters sees a model fitting a hard task",
    ),
    Case(
        "weight_decay_typo",
        "SGD with `weight_decay=5e-1`, a typo for 5e-4 (momentum 0.9, lr 0.1): the weights shrink every step"
        " until the gradient vanishes towards the input",
        _weight_decay_typo,
        "vanishing_gradient",
        "model.1",
        max_steps=8,
        step=7,
        principle=UPDATES,
        default_note="at every_n_steps=50 vanishing_gradient names model.3 at step 50 (the weights have shrunk"
        " further by then, so the cut sits one block later): named on time, at another layer of the same stack;"
        " the bug is in the optimizer's settings, not in a layer, so no layer is more right than another",
    ),
    Case(
        "backward_twice",
        "manual optimization with a debugging `manual_backward(loss, retain_graph=True)` left above the real"
        " one: every gradient is doubled",
        _backward_twice,
        None,
        None,
        max_steps=8,
        principle=BOOKKEEPING,
        blind="nothing, and no layer to name: a doubled gradient is the same run at twice the learning rate"
        " (the loss over the last 10 of 60 steps 1.17 against the twin's 1.20); .grad is zeroed before each step,"
        " so stale_gradients has nothing to see",
    ),
)
"""Issue 38's types, by principle."""
