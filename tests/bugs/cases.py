"""A library of ordinary training bugs, each a small real Lightning fit with its fixed twin.

Nothing is planted inside what the callback observes: every bug arises the way it does for users (a parameter group
left out, a stray ``.detach()``, raw pixels, a forgotten ``zero_grad``), and the twin is the fix a user would apply.
Each :class:`Case` names the rule and the layer the callback should report; :func:`run` trains one side of it.

The bugs come from the issue that asked for them (issue 20) and from the fault taxonomies of Humbatova et al.
(ICSE 2020), DeepDiagnosis (ICSE 2022), AUTOTRAINER (ICSE 2021) and TrainCheck (OSDI 2025), restricted to what a
monitor of layer activations, gradients and parameters can see.

A case with ``rule=None`` is a blind spot or a known miss, with the reason in ``blind``, what the callback reports on
it today in ``today`` and, when one layer is where a right diagnosis points, that layer in ``layer``. Every case
names its class of principle (:data:`PRINCIPLES`); ``principles.py`` adds issue 38's types and ``traincheck.py`` the
ports of TrainCheck's bugs (counted apart).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from helpers import make_trainer
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback

__all__ = ["CASES", "PRINCIPLES", "BugModule", "Case", "Fit", "ManualBug", "run"]

# The class of principle each case belongs to: issue 38's six principles, then the field's other classes.
P1 = "1. parameter life accounted for"
P2 = "2. a module's part in the run"
P3 = "3. scale at both ends"
P4 = "4. a symptom judged by its consequence"
P5 = "5. the origin of growth"
P6 = "6. the optimizers as a whole"
NUMERICAL = "numerical errors (NaN/Inf)"
UNITS = "dead or saturated units"
GRADIENT = "vanishing or exploding gradient"
UPDATES = "update size"
LAYOUT = "preprocessing and layout"
MODE = "train/eval mode"
BOOKKEEPING = "gradient bookkeeping"
DATA = "data pipeline"
PRINCIPLES = (P1, P2, P3, P4, P5, P6, NUMERICAL, UNITS, GRADIENT, UPDATES, LAYOUT, MODE, BOOKKEEPING, DATA)
"""Every class a case may name, in the order of the benchmark's table."""


# ------------------------------------------------------------------------------------------------ the module
class BugModule(pl.LightningModule):
    """``self.model`` trained on fixed data; each knob is one way user code goes wrong (off by default).

    Args:
        model: The network (``self.model``, so layers are named ``model.<child>``).
        data: The training set; batches are taken in order.
        loss: ``"mse"``, ``"ce"`` (cross-entropy on the model's output) or a function ``(module, batch) -> loss``.
        lr: Learning rate.
        optimizer: ``"sgd"`` or ``"adam"``.
        optimized: Which parameters ``configure_optimizers`` hands the optimizer; ``None``: all of them.
        batch_fn: ``(batch_idx, x, y) -> (x, y)``, what the data pipeline does to a batch (a bad batch).
        manual: Manual optimization: ``training_step`` steps the optimizer itself.
        zero_grad: With ``manual``: whether ``training_step`` calls ``optimizer.zero_grad()``.
        on_batch: ``(module, batch_idx)`` called at the start of ``training_step`` (an inner evaluation).
        clip: ``gradient_clip_val`` given to the Trainer by :func:`run`.
        batch_size: Batch size.
        scheduler: ``(optimizer) -> lr_scheduler config`` (the dict ``configure_optimizers`` returns under
            ``"lr_scheduler"``), or ``None``.
    """

    def __init__(
        self,
        model: nn.Module,
        data: TensorDataset,
        loss: str | Callable[[BugModule, Any], Tensor] = "mse",
        lr: float = 0.05,
        optimizer: str = "sgd",
        optimized: Callable[[BugModule], Sequence[nn.Parameter]] | None = None,
        batch_fn: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
        manual: bool = False,
        zero_grad: bool = True,
        on_batch: Callable[[BugModule, int], None] | None = None,
        batch_size: int = 8,
        scheduler: Callable[[torch.optim.Optimizer], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.data = data
        self.loss_kind = loss
        self.lr = lr
        self.optimizer_name = optimizer
        self.optimized = optimized
        self.batch_fn = batch_fn
        self.automatic_optimization = not manual
        self.zero_grad_in_step = zero_grad
        self.on_batch = on_batch
        self.batch_size = batch_size
        self.scheduler = scheduler

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def compute_loss(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.batch_fn is not None:
            x, y = self.batch_fn(batch_idx, x, y)
        if callable(self.loss_kind):
            return self.loss_kind(self, (x, y))
        out = self(x)
        return F.cross_entropy(out, y) if self.loss_kind == "ce" else F.mse_loss(out, y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.on_batch is not None:
            self.on_batch(self, batch_idx)
        loss = self.compute_loss(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        if self.zero_grad_in_step:
            opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss.detach()

    def configure_optimizers(self) -> Any:
        params = list(self.parameters()) if self.optimized is None else list(self.optimized(self))
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(params, lr=self.lr)
        else:
            optimizer = torch.optim.SGD(params, lr=self.lr)
        if self.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler(optimizer)}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)


class ManualBug(BugModule):
    """Manual optimization: ``training_step`` steps the optimizers itself, with the bug (``sick``) or its fix."""

    def __init__(self, sick: bool, **kwargs: Any) -> None:
        super().__init__(manual=True, **kwargs)
        self.sick = sick


# ------------------------------------------------------------------------------------------------ the library
@dataclass(frozen=True)
class Fit:
    """One side of a case: the module and how the Trainer runs it."""

    module: pl.LightningModule
    trainer: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One bug and its fixed twin.

    Attributes:
        name: Short identifier (a test id).
        bug: How the bug arises, in plain words.
        build: ``build(sick)``: the fit with the bug (``True``) or its fixed twin (``False``).
        rule: The rule that must report it; ``None`` for a blind spot.
        layer: The ``Finding.layer`` it must name.
        max_steps: Optimizer steps of both fits.
        callback: Keyword arguments of :class:`~lightning_hookdiag.LayerHealthCallback` besides the defaults
            :func:`run` sets.
        step: The step it must be reported on when that is certain (the bad batch's step; the first step with a
            previous sampled step to compare with); ``None``: any step of the fit.
        blind: For a blind spot: why no rule can see it.
        default_step: The step its rule names it on when the bug reruns with the default ``every_n_steps=50`` for
            ``max(max_steps, 51)`` steps; ``None``: missed there (``default_note`` says what was measured).
        default_note: For a bug missed at the default interval: what the sentinel's every-step signals (the loss;
            the gradients with ``sentinel="loss+grads"``) show, measured, and why no cheap check was added.
        principle: Its class of principle, one of :data:`PRINCIPLES`.
        source: For a port of an external benchmark's bug (TrainCheck): the URL of the issue it reproduces.
        today: For a blind spot or known miss: the ``(rule, layer)`` pairs the callback reports on the bug today
            (empty: nothing); a rule that starts to see it changes them, and the case moves out of the misses.
        twin_today: The ``(rule, layer)`` pairs the fixed twin raises today: a known false alarm, on record.
        twin_note: For a named bug whose twin raises ``twin_today``: why (``blind`` says it for a known miss).
    """

    name: str
    bug: str
    build: Callable[[bool], Fit]
    rule: str | None
    layer: str | None
    max_steps: int = 8
    callback: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    blind: str = ""
    default_step: int | None = None
    default_note: str = ""
    principle: str = ""
    source: str = ""
    today: tuple[tuple[str, str], ...] = ()
    twin_today: tuple[tuple[str, str], ...] = ()
    twin_note: str = ""


def run(case: Case, sick: bool, max_steps: int | None = None, **callback: Any) -> LayerHealthCallback:
    """Train one side of ``case`` with a real Trainer; returns the callback (its ``findings``, ``trips``).

    ``max_steps`` and ``callback`` override the case's (the benchmark also runs the default ``every_n_steps=50``).
    """
    torch.manual_seed(0)
    fit = case.build(sick)
    settings: dict[str, Any] = {"every_n_steps": 1, "on_anomaly": "ignore", "output": {"summary": False}}
    settings.update(case.callback)
    settings.update(callback)
    cb = LayerHealthCallback(**settings)
    trainer = make_trainer([cb], case.max_steps if max_steps is None else max_steps, **fit.trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on NaN losses and tiny runs; findings are read below
        trainer.fit(fit.module)
    return cb


def _data(n: int, d_in: int, d_out: int = 1, classes: int = 0, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    if classes:
        return TensorDataset(x, torch.randint(0, classes, (n,), generator=g))
    return TensorDataset(x, torch.randn(n, d_out, generator=g))


def _mlp(
    d_in: int = 8, width: int = 16, depth: int = 2, d_out: int = 1, act: type[nn.Module] = nn.ReLU
) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), act()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, d_out))


def _body_head(d_in: int = 8, width: int = 16, detach: bool = False) -> nn.Module:
    class BodyHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(d_in, width), nn.ReLU())
            self.head = nn.Linear(width, 1)

        def forward(self, x: Tensor) -> Tensor:
            h = self.body(x)
            return self.head(h.detach() if detach else h)  # the bug: a stray .detach() left from debugging

    return BodyHead()


# --- the eight ------------------------------------------------------------------------------------------
def _head_not_in_optimizer(sick: bool) -> Fit:
    # The bug: configure_optimizers lists the parameters of the body only (the head was added later).
    body_only = (lambda m: m.model.body.parameters()) if sick else None
    return Fit(BugModule(_body_head(), _data(64, 8), optimized=body_only))


def _stray_detach(sick: bool) -> Fit:
    return Fit(BugModule(_body_head(detach=sick), _data(64, 8)))


def _bf16_rounded_away(sick: bool) -> Fit:
    # bf16 weights hold 8 significant bits: an Adam step of 1e-4 is below half an ulp of any weight above ~0.026.
    module = BugModule(_mlp(), _data(64, 8), lr=1e-4, optimizer="adam")
    return Fit(module, {"precision": "bf16-true" if sick else "bf16-mixed"})


def _sgd_lr_too_high(sick: bool) -> Fit:
    return Fit(BugModule(_mlp(8, 32, depth=3), _data(64, 8), lr=3.0 if sick else 0.05))


def _unnormalised_batch(sick: bool) -> Fit:
    # One batch of the stream skipped the normalisation (a corrupt shard): x1000.
    def batch_fn(i: int, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return (x * 1000.0 if sick and i == 26 else x), y

    return Fit(BugModule(_mlp(), _data(8 * 30, 8), lr=0.01, batch_fn=batch_fn))


def _wrong_label_batch(sick: bool) -> Fit:
    # A classifier descending fast towards 0 (below 1e-3 by step 55), then one batch whose labels are shifted by one (a
    # misaligned join). It lands 6 steps after the sampled step 50: the rule compares the layers with that step.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 8, generator=g).repeat(80, 1)
    y = torch.arange(8).repeat(80)

    def batch_fn(i: int, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return x, ((y + 1) % 8 if sick and i == 56 else y)

    return Fit(
        BugModule(_mlp(8, 32, d_out=8), TensorDataset(x, y), loss="ce", lr=0.01, optimizer="adam", batch_fn=batch_fn)
    )


class _Log(nn.Module):
    """A wrapper whose forward is functional code around a child: ``log(self.lin(x))``."""

    def __init__(self, lin: nn.Module, eps: float | None) -> None:
        super().__init__()
        self.lin = lin
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        z = self.lin(x)
        # The bug: log of a Linear output, which is negative for some samples; the fix keeps it positive.
        return torch.log(z) if self.eps is None else torch.log(F.softplus(z) + self.eps)


def _nan_log_in_wrapper(sick: bool) -> Fit:
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(8, 16))
    model.add_module("act", nn.ReLU())
    lin = nn.Linear(16, 4)
    with torch.no_grad():  # a positive bias keeps most outputs above 0, not all: NaN on the first step
        lin.bias.fill_(0.3)
    model.add_module("scale", _Log(lin, None if sick else 1e-6))
    model.add_module("out", nn.Linear(4, 1))
    return Fit(BugModule(model, _data(64, 8), lr=0.2))


class _RNNClassifier(nn.Module):
    def __init__(self, nonlinearity: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.rnn = nn.RNN(16, 32, batch_first=True, nonlinearity=nonlinearity)
        self.head = nn.Linear(32, 4)
        if nonlinearity == "relu":  # identity-like recurrence (IRNN) scaled up: the gradient grows through time
            with torch.no_grad():
                self.rnn.weight_hh_l0.copy_(1.3 * torch.eye(32))

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out[:, -1])


def _exploding_relu_rnn(sick: bool) -> Fit:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 20, (64, 40), generator=g)
    data = TensorDataset(x, x[:, 0] % 4)
    return Fit(BugModule(_RNNClassifier("relu" if sick else "tanh"), data, loss="ce", lr=1e-3, optimizer="adam"))


# --- the fault taxonomies ---------------------------------------------------------------------------------------
def _lr_too_low(sick: bool) -> Fit:
    return Fit(BugModule(_mlp(), _data(64, 8), lr=1e-6 if sick else 0.05))


def _zero_init(sick: bool) -> Fit:
    model = _mlp()
    if sick:  # "start from zeros" (a habit from linear models): every hidden unit is the same, and 0
        for p in model.parameters():
            nn.init.zeros_(p)
    return Fit(BugModule(model, _data(64, 8)))


def _missing_activation(sick: bool) -> Fit:
    # nn.Sequential(Linear, Linear, Linear): the ReLUs were forgotten, the network is one linear map.
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)) if sick else _mlp()
    return Fit(BugModule(model, _data(64, 8)))


def _raw_pixels(sick: bool) -> Fit:
    # 8x8 greyscale images as uint8 values 0-255 fed straight in; the fix scales them to mean 0, std 1.
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (64, 64), generator=g).float()
    labels = (pixels[:, :32].mean(1) > pixels[:, 32:].mean(1)).long()
    x = pixels if sick else (pixels / 255.0 - 0.5) / 0.29
    return Fit(BugModule(_mlp(64, 32, d_out=2), TensorDataset(x, labels), loss="ce", lr=0.01))


def _double_softmax(sick: bool) -> Fit:
    # The model ends in nn.Softmax and its output goes into CrossEntropyLoss, which applies log_softmax again.
    model = _mlp(8, 32, d_out=4)
    if sick:
        model.append(nn.Softmax(dim=-1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return Fit(BugModule(model, TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()), loss="ce", lr=0.5))


def _dying_relus(sick: bool) -> Fit:
    # Adam with lr=0.3 (an SGD habit): the first steps push most pre-activations below 0 for good.
    return Fit(BugModule(_mlp(8, 32, depth=3), _data(64, 8), lr=0.3 if sick else 1e-3, optimizer="adam"))


def _saturating_tanh(sick: bool) -> Fit:
    model = _mlp(16, 64, depth=4, act=nn.Tanh)
    if sick:  # weights drawn from N(0, 1) (torch.randn init): pre-activations of std ~8
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1.0)
    return Fit(BugModule(model, _data(64, 16), lr=0.01))


def _exploding_no_clipping(sick: bool) -> Fit:
    model = _mlp(16, 64, depth=8)
    for m in model:
        if isinstance(m, nn.Linear):
            # The bug: init std 0.5 instead of ~1/sqrt(fan_in), each ReLU block multiplies the gradient by ~2.8; the
            # fix: He init, which keeps it (PyTorch's default init would lose ~2.5x per block, vanishing by block 8).
            nn.init.normal_(m.weight, std=0.5) if sick else nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    return Fit(BugModule(model, _data(64, 16), lr=1e-4))


def _nan_from_sqrt(sick: bool) -> Fit:
    # A siamese distance sqrt(sum(d**2)) on pairs that include identical samples: its gradient at d = 0 is 0 * inf.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 8, generator=g)
    b = torch.where(torch.arange(64)[:, None] % 4 == 0, a, torch.randn(64, 8, generator=g))
    target = (a - b).norm(dim=1, keepdim=True)
    eps = 0.0 if sick else 1e-12

    def loss(module: BugModule, batch: Any) -> Tensor:
        (pair, t) = batch
        za, zb = module(pair[:, :8]), module(pair[:, 8:])
        dist = torch.sqrt(((za - zb) ** 2).sum(dim=1, keepdim=True) + eps)
        return F.mse_loss(dist, t)

    return Fit(BugModule(_mlp(8, 16, d_out=4), TensorDataset(torch.cat([a, b], 1), target), loss=loss, lr=0.01))


def _grads_never_zeroed(sick: bool) -> Fit:
    # Manual optimization: training_step calls opt.step() but not opt.zero_grad(), so .grad sums every past step.
    return Fit(BugModule(_mlp(), _data(64, 8), lr=0.01, manual=True, zero_grad=not sick))


def _eval_mode_left_on(sick: bool) -> Fit:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def inner_eval(module: BugModule, batch_idx: int) -> None:
        if batch_idx == 2:  # a quick look at held-out predictions in the middle of training
            module.model.eval()
            with torch.no_grad():
                module.model(torch.zeros(2, 8))
            if not sick:
                module.model.train()  # the fix: back to training mode

    return Fit(BugModule(model, _data(64, 8), on_batch=inner_eval))


# --- issue 28: the stretch cases, the field's categories ---------------------------------------------------------
class _ListBlocks(nn.Module):
    """Two hidden blocks and a head; the blocks in a Python list (the bug) or an ``nn.ModuleList`` (the fix)."""

    def __init__(self, registered: bool) -> None:
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(8 if i == 0 else 16, 16), nn.ReLU()) for i in range(2)]
        self.blocks = nn.ModuleList(blocks) if registered else blocks
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _layers_in_a_python_list(sick: bool) -> Fit:
    # The PyTorch forum's "my model has no trainable layers": self.parameters() yields only the head's.
    return Fit(BugModule(_ListBlocks(registered=not sick), _data(64, 8)))


class _FirstSampleOnly(TensorDataset):
    """A Dataset whose ``__getitem__`` ignores its index (the bug): every batch is sample 0, repeated."""

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        return super().__getitem__(0)


def _repeated_sample_batch(sick: bool) -> Fit:
    data = _data(64, 8)
    return Fit(BugModule(_mlp(), _FirstSampleOnly(*data.tensors) if sick else data))


def _eval_before_forward(sick: bool) -> Fit:
    # `self.model.eval()` at the top of training_step, copied from an inference snippet (the forum's "eval() before
    # forward"): every training forward runs BatchNorm on running statistics and Dropout off.
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def every_batch(module: BugModule, batch_idx: int) -> None:
        if sick:
            module.model.eval()

    return Fit(BugModule(model, _data(64, 8), on_batch=every_batch))


def _deep_sigmoid(sick: bool) -> Fit:
    # DeepDiagnosis's "vanishing gradient": ten Sigmoid layers; the fix: ReLU with He init.
    model = _mlp(16, 32, depth=10, act=nn.Sigmoid if sick else nn.ReLU)
    if not sick:
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    return Fit(BugModule(model, _data(64, 16), lr=0.01))


def _relu_on_the_output(sick: bool) -> Fit:
    # A regression head ending in ReLU (DeepDiagnosis: "change the last layer's activation") on targets mostly < 0.
    model = _mlp()
    if sick:
        model.append(nn.ReLU())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return Fit(BugModule(model, TensorDataset(x, x[:, :1] - 2.0)))


def _tiny_gradient_clip(sick: bool) -> Fit:
    # gradient_clip_val=1e-6 (a learning rate typed into the clipping value): every update is clipped to nothing.
    return Fit(BugModule(_mlp(), _data(64, 8)), {"gradient_clip_val": 1e-6 if sick else 1.0})


def _step_lr_every_step(sick: bool) -> Fit:
    # StepLR(step_size=1, gamma=0.1) meant per epoch, configured with interval "step": the lr falls 10x a step.
    def scheduler(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
        return {"scheduler": decay, "interval": "step" if sick else "epoch"}

    return Fit(BugModule(_mlp(), _data(64, 8), scheduler=scheduler))


class _BodyHead(nn.Module):
    def __init__(self, no_grad: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.no_grad = no_grad

    def forward(self, x: Tensor) -> Tensor:
        with torch.set_grad_enabled(not self.no_grad):  # the bug: `with torch.no_grad()` from a feature extractor
            h = self.body(x)
        return self.head(h)


def _no_grad_body(sick: bool) -> Fit:
    return Fit(BugModule(_BodyHead(no_grad=sick), _data(64, 8)))


def _sigmoid_into_bce_with_logits(sick: bool) -> Fit:
    # The model ends in nn.Sigmoid and its output goes into BCEWithLogitsLoss, which applies the sigmoid again.
    model = _mlp(8, 32, d_out=1)
    if sick:
        model.append(nn.Sigmoid())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)

    def loss(module: BugModule, batch: Any) -> Tensor:
        return F.binary_cross_entropy_with_logits(module(batch[0]), batch[1])

    return Fit(BugModule(model, TensorDataset(x, (x[:, :1] > 0).float()), loss=loss, lr=0.5))


def _loss_summed_not_averaged(sick: bool) -> Fit:
    # MSELoss(reduction="sum") over a batch of 64 with an lr tuned for the mean: every step is 64x too large.
    def loss(module: BugModule, batch: Any) -> Tensor:
        x, y = batch
        return F.mse_loss(module(x), y, reduction="sum" if sick else "mean")

    return Fit(BugModule(_mlp(8, 32, depth=3), _data(256, 8), loss=loss, lr=0.05, batch_size=64))


def _one_feature_in_raw_units(sick: bool) -> Fit:
    # A tabular feature (a price) left in its raw units, ~1e4, next to standardised ones; the fix standardises it.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(1, keepdim=True)
    if sick:
        x[:, 0] = 2e4 + 5e3 * x[:, 0]
    return Fit(BugModule(_mlp(), TensorDataset(x, y), lr=0.01))


# What was measured for the cases below (kept apart so the table above stays readable).
DEFAULT_NOTES: dict[str, str] = {
    "sgd_lr_too_high": "the ReLUs die at step 4, between the sampled steps 0 and 50. The sentinel's every-step loss"
    " (0.68, 0.87, 0.86, 2.21, 7.96, 150, 8.2e7, then Inf at step 7) trips on the Inf loss of step 7, whose replay"
    " names exploding_gradient on model.6 and the non-finite loss: the run is stopped in time, at the wrong layer."
    " A spike test could not trip earlier: its baseline needs spike_warmup=20 healthy steps; loss+grads trips on"
    " the same step 7",
    "step_lr_every_step": "nothing fires in 101 steps: by steps 50 and 100 the lr is 5e-52 and 5e-102 and every"
    " update is exactly 0 in float32, which not_updated leaves to a scheduler (a warm-up also holds the lr at 0) and"
    " update_ratio does not see below its first sampled step. The every-step signals are healthy: the loss cycles"
    " through the epoch's 8 batches (0.48-1.99) without a trip, the gradients stay finite (loss+grads); the lr itself,"
    " fallen 1e10x while a scheduler is attached, is what would show it, and the sentinel does not read it",
    "loss_summed_not_averaged": "the sentinel trips on the Inf loss of step 5 (53, 61, 985, 3.3e4, 2.1e11, Inf) and"
    " its replay names exploding_gradient on model.6 and nonfinite on model.4 at step 5: detected on time by the"
    " every-step loss, one layer off (every layer's gradient is 64x, so no layer makes the explosion; loss+grads"
    " trips on the same step)",
}
BLIND_NOTES: dict[str, str] = {
    "no_grad_body": "the body's outputs do not require grad, so no gradient is missing from them (no_gradient is"
    " about outputs that require grad) and its parameters get none (.grad stays None), which is exactly how a"
    " backbone frozen on purpose with torch.no_grad() looks in linear-probe code; the head trains normally (after 60"
    " steps: output gradient 1.02, update ratio 0.14), so a rule would fire on intentional freezing",
}

CASES: tuple[Case, ...] = (
    Case(
        "head_not_in_optimizer",
        "configure_optimizers lists the body's parameters only: the head gets gradients and never changes",
        _head_not_in_optimizer,
        "not_updated",
        "model.head",
        max_steps=4,
        default_step=0,
        principle=P1,
    ),
    Case(
        "stray_detach",
        "`self.head(self.body(x).detach())` left from debugging: the body gets no gradient",
        _stray_detach,
        "no_gradient",
        "model.body.0",
        max_steps=4,
        default_step=0,
        principle=P2,
    ),
    Case(
        "bf16_rounded_away",
        "`precision='bf16-true'` with Adam at lr=1e-4: 92-97% of the first layer's weights never change a step",
        _bf16_rounded_away,
        "not_updated",
        "model.0",
        max_steps=4,
        default_step=0,
        principle=P1,
    ),
    Case(
        "sgd_lr_too_high",
        "SGD at lr=3 on a ReLU MLP: the ReLUs die layer after layer",
        _sgd_lr_too_high,
        "dead_units",
        "model.5",
        step=4,
        default_note=DEFAULT_NOTES["sgd_lr_too_high"],
        principle=UNITS,
    ),
    Case(
        "unnormalised_batch",
        "one batch (step 26) skipped the normalisation: inputs x1000",
        _unnormalised_batch,
        "loss_spike",
        "model.0",
        max_steps=28,
        callback={"every_n_steps": 50},
        step=26,
        default_step=26,
        principle=DATA,
    ),
    Case(
        "wrong_label_batch",
        "a classifier in fast descent (median loss 3.6e-4) gets one batch with shifted labels: 15.9 at step 56",
        _wrong_label_batch,
        "loss_spike",
        "loss",
        max_steps=58,
        callback={"every_n_steps": 50},
        step=56,
        default_step=56,
        principle=DATA,
    ),
    Case(
        "nan_log_in_wrapper",
        "`log(self.lin(x))` in a wrapper module (`model.scale`); the Linear output is negative for some samples",
        _nan_log_in_wrapper,
        "nonfinite",
        "model.scale",
        max_steps=12,
        callback={"every_n_steps": 50},
        default_step=0,
        principle=NUMERICAL,
    ),
    Case(
        "exploding_relu_rnn",
        "a ReLU nn.RNN with an identity-like recurrence of gain 1.3 over 40 time steps",
        _exploding_relu_rnn,
        "exploding_gradient",
        "model.rnn",
        max_steps=3,
        default_step=0,
        principle=GRADIENT,
    ),
    Case(
        "lr_too_low",
        "SGD at lr=1e-6 (a typo for 1e-2): the weights barely move",
        _lr_too_low,
        "update_ratio",
        "model.0",
        max_steps=4,
        step=1,
        default_step=50,
        principle=UPDATES,
    ),
    Case(
        "zero_init",
        "every weight and bias initialised to 0: all hidden units are 0, the ReLUs pass nothing",
        _zero_init,
        "dead_units",
        "model.1",
        max_steps=3,
        step=0,
        default_step=0,
        principle=UNITS,
    ),
    Case(
        "missing_activation",
        "`nn.Sequential(Linear, Linear, Linear)`: the activations were forgotten",
        _missing_activation,
        None,
        None,
        max_steps=4,
        blind="a stack of Linear layers is numerically healthy: every statistic is in range (after 60 steps the"
        " output gradient norms are 0.92, 0.56, 0.51 from the output end), only capacity is lost",
        principle=LAYOUT,
    ),
    Case(
        "raw_pixels",
        "8x8 images as raw 0-255 values fed straight into the first Linear",
        _raw_pixels,
        "input_scale",
        "model.0",
        max_steps=3,
        step=0,
        default_step=0,
        principle=P3,
    ),
    Case(
        "double_softmax",
        "the model ends in nn.Softmax and CrossEntropyLoss applies log_softmax again",
        _double_softmax,
        "squashed_twice",
        "model.5",  # the nn.Softmax appended to _mlp(8, 32, d_out=4)
        max_steps=8,
        step=0,
        default_step=0,
        principle=P4,
    ),
    Case(
        "dying_relus",
        "Adam at lr=0.3: most ReLU units are pushed below 0 for every sample",
        _dying_relus,
        "dead_units",
        "model.3",
        default_step=50,
        principle=UNITS,
    ),
    Case(
        "saturating_tanh",
        "a Tanh MLP whose weights were drawn from N(0, 1): pre-activations of std ~8",
        _saturating_tanh,
        "saturation",
        "model.3",
        max_steps=3,
        step=0,
        default_step=0,
        principle=UNITS,
    ),
    Case(
        "exploding_no_clipping",
        "an 8-block ReLU MLP initialised with std 0.5, trained without gradient clipping: the loss turns to Inf",
        _exploding_no_clipping,
        "exploding_gradient",
        "model.0",
        max_steps=3,
        step=0,
        default_step=0,
        principle=P5,
    ),
    Case(
        "nan_from_sqrt",
        "a siamese distance `sqrt(sum(d**2))` on pairs with identical samples: the gradient at 0 is NaN",
        _nan_from_sqrt,
        "nonfinite",
        "model.4",
        max_steps=3,
        step=0,
        default_step=0,
        principle=NUMERICAL,
    ),
    Case(
        "grads_never_zeroed",
        "manual optimization whose training_step calls opt.step() but never opt.zero_grad()",
        _grads_never_zeroed,
        "stale_gradients",
        "model.0",
        max_steps=4,
        step=1,
        default_step=50,
        principle=BOOKKEEPING,
    ),
    Case(
        "eval_mode_left_on",
        "`self.model.eval()` for a quick look at step 2, never switched back: BatchNorm and Dropout stop training",
        _eval_mode_left_on,
        "eval_mode",
        "model.1",
        max_steps=5,
        default_step=50,
        principle=MODE,
    ),
    # --- issue 28 ---------------------------------------------------------------------------------------------
    Case(
        "layers_in_a_python_list",
        "hidden blocks in a Python list, not nn.ModuleList: in no optimizer and no checkpoint (no trainable layers)",
        _layers_in_a_python_list,
        "unregistered_module",
        "model",
        max_steps=3,
        step=0,
        default_step=0,
        principle=P1,
    ),
    Case(
        "repeated_sample_batch",
        "a Dataset whose __getitem__ ignores its index: every batch is one sample, repeated",
        _repeated_sample_batch,
        "repeated_batch",
        "<batch>",
        max_steps=3,
        step=0,
        default_step=0,
        principle=DATA,
    ),
    Case(
        "eval_before_forward",
        "`self.model.eval()` at the top of training_step (copied from inference code): BatchNorm never trains",
        _eval_before_forward,
        "eval_mode",
        "model.1",
        max_steps=4,
        default_step=50,
        principle=MODE,
    ),
    Case(
        "deep_sigmoid",
        "ten Sigmoid layers: the gradient fades towards the input",
        _deep_sigmoid,
        "vanishing_gradient",
        "model.12",
        max_steps=3,
        step=0,
        default_step=0,
        principle=GRADIENT,
    ),
    Case(
        "relu_on_the_output",
        "a regression head ending in ReLU, targets mostly below 0: the output unit dies",
        _relu_on_the_output,
        "dead_units",
        "model.5",
        max_steps=4,
        default_step=50,
        principle=UNITS,
    ),
    Case(
        "tiny_gradient_clip",
        "`gradient_clip_val=1e-6` (a learning rate typed into the clipping value): every update is clipped away",
        _tiny_gradient_clip,
        "update_ratio",
        "model.0",
        max_steps=4,
        step=1,
        default_step=50,
        principle=UPDATES,
    ),
    Case(
        "step_lr_every_step",
        "StepLR(step_size=1, gamma=0.1) meant per epoch, configured with interval 'step': the lr falls 10x a step",
        _step_lr_every_step,
        "update_ratio",
        "model.0",
        max_steps=10,
        default_note=DEFAULT_NOTES["step_lr_every_step"],
        principle=P6,
    ),
    Case(
        "loss_summed_not_averaged",
        "MSELoss(reduction='sum') over batches of 64 with an lr tuned for the mean: each step is 64x too large",
        _loss_summed_not_averaged,
        "exploding_gradient",
        "model.4",
        max_steps=8,
        default_note=DEFAULT_NOTES["loss_summed_not_averaged"],
        principle=GRADIENT,
    ),
    Case(
        "one_feature_in_raw_units",
        "one tabular feature (a price, ~2e4) left in raw units next to standardised ones",
        _one_feature_in_raw_units,
        "input_scale",
        "model.0",
        max_steps=3,
        step=0,
        default_step=0,
        principle=P3,
    ),
    Case(
        "no_grad_body",
        "the body's forward inside `torch.no_grad()` (copied from feature extraction) while meant to be fine-tuned",
        _no_grad_body,
        None,
        None,
        max_steps=4,
        blind=BLIND_NOTES["no_grad_body"],
        principle=P1,
    ),
    Case(
        "sigmoid_into_bce_with_logits",
        "the model ends in nn.Sigmoid and BCEWithLogitsLoss applies the sigmoid again",
        _sigmoid_into_bce_with_logits,
        "squashed_twice",
        "model.5",  # the nn.Sigmoid appended to _mlp(8, 32, d_out=1)
        max_steps=8,
        step=0,
        default_step=0,
        principle=P4,
    ),
)

"""Every bug of the benchmark, in the order of the table in ``docs/bugs.md``."""

from misses import MISSES  # noqa: E402  (the held-out misses of issue 28 build on BugModule above)
from principles import PRINCIPLE_CASES  # noqa: E402  (issue 38's types, on BugModule too)
from traincheck import PORTS  # noqa: E402  (TrainCheck's bugs ported, counted apart: Case.source is set)

CASES += MISSES + PRINCIPLE_CASES + PORTS

BY_NAME: dict[str, Case] = {case.name: case for case in CASES}
