"""Ports of TrainCheck's silent training bugs (Jiang et al., OSDI 2025) to small Lightning fits, with their fixes.

TrainCheck's artifact (github.com/OrderLab/TrainCheck, docs/ae-eval-s5.1-silent-issue-detection.md) lists 18 bugs
with reproduction scripts in github.com/OrderLab/TrainCheck-Evaluation-Workloads
(silent-issue-detection/bug-reprod-scripts); the paper counts 20. Each bug that reproduces on a CPU in seconds is
ported here, citing its source issue; :data:`NOT_PORTED` says for each of the others why not. The ports are counted
apart from the other cases (``Case.source`` is set); ``cases.py`` appends :data:`PORTS` to its ``CASES``.
"""

from __future__ import annotations

from typing import Any

import torch
from cases import BOOKKEEPING, DATA, MODE, P1, BugModule, Case, Fit
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["NOT_PORTED", "PORTS"]

WORKLOADS = (
    "https://github.com/OrderLab/TrainCheck-Evaluation-Workloads/tree/main/silent-issue-detection/bug-reprod-scripts"
)


def _images(n: int, classes: int, seed: int = 0) -> TensorDataset:
    # 8x8 single-channel images whose class is which quadrant is brightest: learnable by a small CNN.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    for k in range(classes):
        r, c = divmod(k, 2)
        x[y == k, :, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 1.5
    return TensorDataset(x, y)


# --- pytorch-forum-84911: every layer frozen but the BatchNorms, the new head too -------------------------------
class _EfficientNetLike(nn.Module):
    """EfficientNet's parameter names (``_conv_stem``, ``_bn0``, ``_fc``) at 8x8: the names the bug filters on."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self._conv_stem = nn.Conv2d(1, 8, 3, padding=1)
        self._bn0 = nn.BatchNorm2d(8)
        self._conv_head = nn.Conv2d(8, 16, 3, padding=1)
        self._bn1 = nn.BatchNorm2d(16)
        self._fc = nn.Linear(16, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.silu(self._bn0(self._conv_stem(x)))
        x = F.silu(self._bn1(self._conv_head(x)))
        return self._fc(x.mean(dim=(2, 3)))


class _HeadOnlyAdam(BugModule):
    """``optim.Adam(model._fc.parameters(), lr=0.001)``, as in the forum post."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.model._fc.parameters(), lr=self.lr)


def _only_bn_trains(sick: bool) -> Fit:
    model = _EfficientNetLike()
    for name, param in model.named_parameters():
        if "bn" not in name:
            param.requires_grad = False
    for param in model._fc.parameters():
        param.requires_grad = not sick  # the bug: the new head is frozen too (the published fix: True)
    return Fit(_HeadOnlyAdam(model, _images(64, 4), loss="ce", lr=1e-3))


# --- stackoverflow-60335387: optimizer.zero_grad() missing ---------------------------------------------------------
class _MnistNet(nn.Module):
    """The question's MNIST network (two convolutions, two Linears) at 8x8."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = F.max_pool2d(x, 2).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def _zero_grad_missing(sick: bool) -> Fit:
    # The question's loop `pred = model(data); loss.backward(); optimizer.step()` without optimizer.zero_grad(): in
    # Lightning that loop is manual optimization. Adam at lr=1e-4, as in the question.
    module = BugModule(
        _MnistNet(), _images(64, 4), loss="ce", lr=1e-4, optimizer="adam", manual=True, zero_grad=not sick
    )
    return Fit(module)


# --- pytorch-84803 (and baichuan2-86, pytorch-96600): data lost in a transfer ------------------------------------
class _LossyTransfer(BugModule):
    """TrainCheck's fault injection of a lossy GPU transfer (``Tensor.to`` zeroes the tensor), on one batch.

    TrainCheck zeroes 1% of transferred tensors at random; here the batch of step 5 is zeroed (``sick``), so the
    test is deterministic. ``transfer_batch_to_device`` is the hook through which Lightning moves every batch.
    """

    def __init__(self, sick: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sick = sick

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        x, y = super().transfer_batch_to_device(batch, device, dataloader_idx)
        if self.sick and self.trainer.global_step == 5:
            x = torch.zeros_like(x)  # the data lost on the way, as the injected fault does
        return x, y


def _zeroed_in_transfer(sick: bool) -> Fit:
    return Fit(_LossyTransfer(sick, model=_MnistNet(), data=_images(64, 4), loss="ce", lr=1e-3, optimizer="adam"))


# --- transformers-33844: attention dropout applied in eval mode --------------------------------------------------
class _Attention(nn.Module):
    """One self-attention layer through ``F.scaled_dot_product_attention``, as transformers' FlashAttention2 path.

    ``respect_mode``: the fix, ``dropout_p=self.dropout if self.training else 0.0``.
    """

    def __init__(self, respect_mode: bool, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = 0.5
        self.respect_mode = respect_mode

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # The bug: the dropout probability passed in whatever the module's mode, so eval() does not turn it off.
        p = self.dropout if self.training or not self.respect_mode else 0.0
        return self.out(F.scaled_dot_product_attention(q, k, v, dropout_p=p))


class _Tagger(nn.Module):
    def __init__(self, respect_mode: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.attn = _Attention(respect_mode)
        self.head = nn.Linear(16, 12)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.attn(self.embed(x)))


class _WithValidation(BugModule):
    """Trains on a copy task and validates every 4 steps (where the eval-mode dropout bites)."""

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def compute_loss(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())


def _dropout_in_eval(sick: bool) -> Fit:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 12, (32, 6), generator=g)
    module = _WithValidation(_Tagger(respect_mode=not sick), TensorDataset(tokens, tokens), lr=1e-2, optimizer="adam")
    return Fit(module, {"val_check_interval": 4, "limit_val_batches": 1})


# --- mmpretrain-702: frozen_stages applied only by train() ---------------------------------------------------------
class _VGG(nn.Module):
    """mmcls's VGG with ``frozen_stages=1``: ``_freeze_stages`` runs in ``train()``; ``at_init``: also in ``__init__``.

    mmcls's ResNet, RegNet and ConvNeXt freeze in ``__init__`` too (the fix); VGG and most others do not, so the
    stage trains unless ``model.train()`` is called before training. Lightning restores each module's mode by
    setting its ``training`` flag, without calling ``train()``: under Lightning the bug reproduces (measured: the
    stage's weights move at step 0).
    """

    def __init__(self, at_init: bool) -> None:
        super().__init__()
        self.stage0 = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU())
        self.stage1 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(16, 4)
        if at_init:
            self._freeze_stages()

    def _freeze_stages(self) -> None:
        self.stage0.eval()
        for param in self.stage0.parameters():
            param.requires_grad = False

    def train(self, mode: bool = True) -> _VGG:
        super().train(mode)
        self._freeze_stages()
        return self

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stage1(self.stage0(x)).mean(dim=(2, 3)))


def _frozen_stages_not_applied(sick: bool) -> Fit:
    return Fit(BugModule(_VGG(at_init=not sick), _images(64, 4), loss="ce", lr=0.05))


PORTS: tuple[Case, ...] = (
    Case(
        "tc_pytorch_forum_84911",
        "EfficientNet fine-tuning: every parameter without 'bn' in its name frozen, the new `_fc` head frozen"
        " too, and Adam built over `_fc` only: nothing the optimizer holds gets a gradient (the fix unfreezes `_fc`)",
        _only_bn_trains,
        "idle_optimizer",
        "model._fc",
        max_steps=4,
        step=0,
        default_step=0,
        principle=P1,
        source="https://discuss.pytorch.org/t/obtaining-abnormal-changes-in-loss-and-accuracy/84911",
        twin_today=(("not_updated", "model._bn1"), ("not_updated", "model._bn0")),
        twin_note="true on both sides, kept: the BatchNorms keep requires_grad=True and get gradients that no"
        " optimizer applies (the forum's fix unfreezes `_fc` and still leaves them out of Adam), so not_updated names"
        " them on the bug and on the fix alike; the twin counts as not silent",
    ),
    Case(
        "tc_stackoverflow_60335387",
        "the question's MNIST loop without `optimizer.zero_grad()` (manual optimization, Adam at lr=1e-4)",
        _zero_grad_missing,
        "stale_gradients",
        "model.conv1",
        max_steps=4,
        step=1,
        default_step=50,
        principle=BOOKKEEPING,
        source="https://stackoverflow.com/questions/60335387/pytorch-mnist-example-not-converge",
    ),
    Case(
        "tc_pytorch_84803",
        "data lost in a host-to-device transfer (TrainCheck's fault injection: `Tensor.to` zeroes the tensor),"
        " here the batch of step 5; also stands for baichuan2-86 and pytorch-96600, which TrainCheck reproduces the"
        " same way",
        _zeroed_in_transfer,
        "repeated_batch",
        "<batch>",
        max_steps=8,
        step=5,
        principle=DATA,
        source="https://github.com/pytorch/pytorch/issues/84803",
        default_note="the zeroed batch of step 5 falls between the sampled steps 0 and 50, and the every-step loss"
        " of that batch does not trip the sentinel (callback.trips is empty): one lost batch in 50 is invisible at"
        " the default interval, as TrainCheck's 1% fault rate would be",
    ),
    Case(
        "tc_transformers_33844",
        "attention dropout passed to `scaled_dot_product_attention` whatever the module's mode (transformers'"
        " FlashAttention2 path): validation runs with dropout on",
        _dropout_in_eval,
        None,
        "model.attn",
        max_steps=8,
        principle=MODE,
        source="https://github.com/huggingface/transformers/pull/33844",
        blind="nothing: the bug acts in validation only (measured: two eval forwards of the same input differ on"
        " the bug and agree on the fix), and the callback watches training steps; in training, dropout on is"
        " correct",
    ),
    Case(
        "tc_mmpretrain_702",
        "mmcls VGG with `frozen_stages=1`, whose `_freeze_stages()` runs only in `train()`: Lightning restores"
        " modes without calling `train()`, so the stage meant to be frozen trains (the fix also freezes in `__init__`)",
        _frozen_stages_not_applied,
        None,
        "model.stage0.0",
        max_steps=4,
        principle=P1,
        source="https://github.com/open-mmlab/mmpretrain/issues/702",
        blind="nothing on either side: the stage that should be frozen trains normally (measured: its weights move"
        " on the bug, not on the fix); that it was meant to be frozen lives only in the config, so no invariant of"
        " a healthy run separates the two (TrainCheck catches it by an API-order invariant, `train()` before"
        " `forward`, learned from other pipelines)",
    ),
)
"""The ports, by TrainCheck's bug id."""

NOT_PORTED: tuple[tuple[str, str, str], ...] = (
    (
        "baichuan2-86",
        "https://github.com/baichuan-inc/Baichuan2/issues/86",
        "faulty GPU peer-to-peer transfers on multi-GPU inference (hardware): TrainCheck reuses pytorch-84803's"
        " fault injection, ported as `tc_pytorch_84803`",
    ),
    (
        "pytorch-96600",
        "https://github.com/pytorch/pytorch/issues/96600",
        "the same hardware data loss on multiple RTX 4090s: reproduced through pytorch-84803's fault injection,"
        " ported as `tc_pytorch_84803`",
    ),
    (
        "deepspeed-1801",
        "https://github.com/microsoft/DeepSpeed/pull/1801",
        "DeepSpeed 0.6.2's BF16_Optimizer clipping norm weights differently on tensor-parallel ranks > 0: needs"
        " DeepSpeed, Megatron-DeepSpeed and 2+ GPUs with tensor parallelism (the replica class is replica_divergence's,"
        " tested with DDP on gloo)",
    ),
    (
        "deepspeed-5794",
        "https://github.com/microsoft/DeepSpeed/issues/5794",
        "a hang of DeepSpeed 0.15.4's MoE all_to_all with tokens spread unevenly over expert workers: needs"
        " DeepSpeed MoE on several processes, and it is a hang, not a numeric symptom",
    ),
    (
        "lightning-thunder-725",
        "https://github.com/Lightning-AI/lightning-thunder/issues/725",
        "thunder's autocast transform skipping thunder.prims.linear: needs lightning-thunder at the regressing"
        " commit and CUDA mixed precision; not a bug a Lightning user's code makes",
    ),
    (
        "pytorch-104336",
        "https://github.com/pytorch/pytorch/issues/104336",
        "a DDP model moved GPU -> CPU -> GPU loses its gradient-sync hooks: needs a device move under multi-process"
        " DDP (on one CPU device `.cpu()` is a no-op); replicas drifting apart is replica_divergence's, tested with 2"
        " gloo processes",
    ),
    (
        "pytorch-115607",
        "https://github.com/pytorch/pytorch/issues/115607",
        "torch._dynamo skipping the optimizer's step count when grads are None, in torch 2.2.2: a compiler bug of"
        " an old version (this suite runs torch 2.13)",
    ),
    (
        "pytorch-51800",
        "https://github.com/pytorch/pytorch/issues/51800",
        "spectral_norm's power iteration not run when the model is put in eval() before any forward: an"
        " evaluation of the initialisation outside training; a fit runs forward in train mode first, so a training"
        " monitor has nothing to see",
    ),
    (
        "stackoverflow-67180955",
        "https://stackoverflow.com/questions/67180955",
        "DataLoader workers sharing one NumPy seed (identical augmentations): fixed in torch 1.9 (pytorch PR"
        " 56488); needs torch 1.8",
    ),
    (
        "transformers-17877",
        "https://github.com/huggingface/transformers/pull/17877",
        "GPT-2's _init_weights run repeatedly on the same parameters (slow start-up) in transformers 4.20.1: a"
        " performance bug of an old library version, with no training signal",
    ),
    (
        "transformers-23723",
        "https://github.com/huggingface/transformers/issues/23723",
        "Whisper's generate ignoring max_new_tokens with long prompt_ids: an inference (generation) bug, not a"
        " training one",
    ),
    (
        "transformers-34204",
        "https://github.com/huggingface/transformers/issues/34204",
        "PixtralProcessor collapsing a batch of 50 into 1 in transformers 4.45.2: needs that processor and a VLM;"
        " the behaviour is a library version's",
    ),
    (
        "x-jxmnop-ddp-out-of-sync",
        "https://x.com/jxmnop/status/1778520637193240892",
        "a Trainer that wraps the model in DDP on some runs and not others, so gradients are not synchronised:"
        " needs multi-process DDP; replicas out of sync are replica_divergence's, tested with 2 gloo processes",
    ),
)
"""``(bug id, source issue, why it is not ported)`` for each of TrainCheck's bugs without a port of its own."""
