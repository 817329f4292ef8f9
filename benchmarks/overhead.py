"""Step-time overhead of ``LayerHealthCallback`` against plain training and a tutorial-style reference callback.

Method
------
Three standard models are trained on synthetic data (fixed seeds, one pre-generated set of batches per model) with a
real ``lightning.pytorch.Trainer`` on the CPU and the Adam optimizer:

* ``mlp``: 12 hidden ``Linear(512, 512)`` + ``ReLU`` blocks and a linear head, batch 256;
* ``transformer``: token embedding, 4 ``nn.TransformerEncoderLayer`` (d_model 256, 4 heads, feed-forward 1024,
  ``batch_first``), mean pooling and a linear head; sequence 128, batch 16;
* ``cnn``: 6 ``Conv2d`` 3x3 + ``BatchNorm2d`` + ``ReLU`` (channels 3-32-32-64-64-128-128, max-pooling after the
  2nd and 4th), global average pooling and a linear head; 32x32 inputs, batch 64.

Every ``ReLU`` is non-inplace so that the ``tutorial`` reference (which uses ``register_full_backward_hook``) runs.

Variants:

* ``plain``: no diagnostics callback;
* ``every_step``: ``LayerHealthCallback(every_n_steps=1)``: every statistic on every leaf layer, every step;
* ``default_interval``: ``LayerHealthCallback()``, i.e. one sampled step every 50;
* ``tutorial``: :class:`TutorialCallback`, diagnostics written the way tutorials write them: always-on forward
  hooks storing ``output.detach().std().item()``, full backward hooks storing ``grad_output[0].norm().item()`` and
  ``p.grad.norm().item()`` of every parameter in ``on_before_optimizer_step``, kept in a dict (not logged, so that
  the reference pays no logging cost the callback does not pay either, since ``logger=False``).

Optional extra variants (``--variants``) split ``every_step`` by statistic family: ``acts_only``, ``grads_only`` and
``params_only``; ``hooks_noop`` and ``hooks_one_read`` price the hook machinery alone and with one ``sum`` per output
and output gradient (:class:`HookFloorCallback`); ``opt_in`` is ``every_step`` plus every opt-in statistic
(``OPT_IN_STATS``) with two precision targets; ``precursors`` is ``every_step`` plus the attention-logit and
output-logit statistics (``PRECURSOR_STATS``), whose cost at the default interval is ``(precursors - every_step) /
50``. ``fast_off`` and ``fast_on`` are ``every_step`` with ``MeasureConfig(fast_path="off")`` and ``"on"``: the two
paths of a sampled step side by side (``"auto"``, ``every_step``'s, is off on the CPU and on on CUDA); each fit of
``fast_on`` warms the compiled reduction after its first step (dropped with ``--warmup``), from dynamo's cache after
the first fit of the run.

Timing: a :class:`StepTimer` callback, listed first, records ``time.perf_counter_ns()`` in ``on_train_batch_start``.
The interval between two consecutive starts is one whole training step: data fetch, forward, backward, optimizer
step and every callback's batch start/end work (including the callback's pooling and host transfer, which happen in
``on_train_batch_end`` after the optimizer step). The first ``--warmup`` intervals of every fit are dropped.

Drift: the machine is shared and noisy, so variants are interleaved. Each of ``--rounds`` rounds runs every variant
once, for a block of steps, in a rotated order; a fresh model is built from the same seed for every block, so all
variants do bit-identical work. Step times are pooled over rounds and summarised by their median.

``default_interval`` is summarised by its amortised cost per step over whole 50-step periods, because its median
would hide the sampled step. Its block is a multiple of 50 steps, so it holds exactly one sampled step per 50
(steps ``k`` with ``k % 50 == 0``). Comparing two blocks resolves a few percent at best on a shared machine, below
a 1 % target, so the reported number is built from differences inside the same blocks: ``plain + (median(sampled)
- median(unsampled)) / 50 + the callback's own time on an unsampled step`` (timed by wrapping its batch-level
methods). The raw measurement, the median over 50-step periods of the period's mean step time divided by plain's
mean step time, is reported next to it.

Floor: the bytes the statistics of one sampled step must read at least, once each: every selected output and its
gradient, the weights and gradients, and the update snapshot (weights written to a copy, then the new weights and
the copy read back after the step: ``activations + activation grads + grads + 4 * weights``). Sizes come from one
forward/backward pass with hooks that only record shapes and dtypes. The floor time is the median time of
``buffer.sum()`` over a float32 buffer of that many bytes on the same machine (a pure streaming read), so
``(every_step - plain) / floor`` says how far the sampled step is from a single fused pass over its data.

``--profile`` additionally runs a few ``every_step`` steps per model with the library's functions wrapped in
wall-clock timers (inclusive time per component) and under ``torch.profiler`` (self CPU time per aten op).

Usage::

    python benchmarks/overhead.py                        # full run, writes benchmarks/results.json
    python benchmarks/overhead.py --quick                # tiny smoke test, < 60 s
    python benchmarks/overhead.py --models mlp --rounds 5 --steps 60 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F  # noqa: N812
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._errors import LayerHealthWarning
from lightning_hookdiag._step_state import Trip
from lightning_hookdiag._vocabulary import (
    ACTIVATION_STATS,
    ALL_STATS,
    GRADIENT_STATS,
    OPT_IN_STATS,
    PARAMETER_STATS,
    PRECURSOR_STATS,
)

PERIOD = 50
"""``every_n_steps`` default of ``LayerHealthCallback``: the length of one amortisation period."""
TRAINER_DEVICE = {"accelerator": "cpu", "precision": "32-true"}
"""Where and how every fit of the run trains (``--accelerator``, ``--precision``)."""

DEFAULT_VARIANTS = ("plain", "every_step", "default_interval", "tutorial")
EXTRA_VARIANTS = (
    "acts_only",
    "grads_only",
    "params_only",
    "hooks_noop",
    "hooks_one_read",
    "no_sentinel",
    "sentinel_loss",
    "sentinel_grads",
    "replay",
    "opt_in",
    "precursors",
    "tutorial_stats",
    "fast_off",
    "fast_on",
)
TUTORIAL_STATS = ("act_mean", "act_std", "act_grad_norm", "param_grad_norm")
"""What :class:`TutorialCallback` computes (its ``std`` needs the mean), as ``LayerHealthCallback`` statistics."""
NEVER = 10**9
"""An interval no benchmark reaches: only step 0 (dropped as warm-up) is sampled, so what remains is the per-step
cost of the sentinel (``sentinel_*``) or of the callback doing nothing (``no_sentinel``)."""
MODELS = ("mlp", "transformer", "cnn", "mlp48", "gpt2")


# ------------------------------------------------------------------------------------------------------- models
def _mlp(width: int, depth: int, classes: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class _Transformer(nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, ff: int, depth: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, ff, batch_first=True) for _ in range(depth)
        )
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


class _GPT2Block(nn.Module):
    """GPT-2's block with its leaf layout: ln_1, attn (c_attn, c_proj, resid_dropout), ln_2, mlp (c_fc, act, c_proj,
    dropout); attention through ``F.scaled_dot_product_attention`` as transformers' ``sdpa`` path does."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.resid_dropout = nn.Dropout(0.1)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")
        self.mlp_proj = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.resid_dropout(self.attn_proj(a))
        return x + self.dropout(self.mlp_proj(self.act(self.c_fc(self.ln_2(x)))))


class _GPT2(nn.Module):
    """A tiny GPT-2-like language model (25 leaf layers with 2 blocks), predicting the next token."""

    def __init__(self, vocab: int, d: int, heads: int, depth: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(_GPT2Block(d, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)).flatten(0, 1)  # [batch * seq, vocab]: cross-entropy per token


def _cnn(channels: tuple[int, ...], classes: int) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (c_in, c_out) in enumerate(zip(channels[:-1], channels[1:], strict=True)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
        if i in (1, 3):
            layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels[-1], classes)]
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class ModelSpec:
    """How to build one benchmark model and its synthetic batches."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[Tensor, Tensor]]


def model_specs(quick: bool) -> dict[str, ModelSpec]:
    """The three benchmark models, full size or (``quick``) tiny."""
    classes = 10
    if quick:
        width, depth, batch_mlp = 64, 4, 32
        d_model, heads, ff, t_depth, seq, batch_tf, vocab = 32, 4, 64, 2, 16, 4, 100
        channels, side, batch_cnn = (3, 8, 8, 16, 16, 32, 32), 16, 8
        small_depth, small_batch, g_vocab, g_d, g_seq, g_batch = 8, 16, 50, 16, 8, 2
    else:
        width, depth, batch_mlp = 512, 12, 256
        d_model, heads, ff, t_depth, seq, batch_tf, vocab = 256, 4, 1024, 4, 128, 16, 1000
        channels, side, batch_cnn = (3, 32, 32, 64, 64, 128, 128), 32, 64
        small_depth, small_batch, g_vocab, g_d, g_seq, g_batch = 48, 64, 1000, 64, 64, 8

    def labels(g: torch.Generator, n: int) -> Tensor:
        return torch.randint(0, classes, (n,), generator=g)

    return {
        "mlp": ModelSpec(
            "mlp",
            f"{depth}x (Linear({width},{width}) + ReLU) + Linear head, batch {batch_mlp}",
            lambda: _mlp(width, depth, classes),
            lambda g: (torch.randn(batch_mlp, width, generator=g), labels(g, batch_mlp)),
        ),
        "transformer": ModelSpec(
            "transformer",
            f"Embedding + {t_depth}x TransformerEncoderLayer(d_model={d_model}, nhead={heads}, ff={ff},"
            f" batch_first) + mean pool + Linear head, seq {seq}, batch {batch_tf}",
            lambda: _Transformer(vocab, d_model, heads, ff, t_depth, classes),
            lambda g: (torch.randint(0, vocab, (batch_tf, seq), generator=g), labels(g, batch_tf)),
        ),
        "cnn": ModelSpec(
            "cnn",
            f"6x (Conv2d 3x3 + BatchNorm2d + ReLU), channels {'-'.join(map(str, channels))}, 2 MaxPool2d,"
            f" avg pool + Linear head, {side}x{side} inputs, batch {batch_cnn}",
            lambda: _cnn(channels, classes),
            lambda g: (torch.randn(batch_cnn, 3, side, side, generator=g), labels(g, batch_cnn)),
        ),
        "mlp48": ModelSpec(
            "mlp48",
            f"{small_depth}x (Linear(64,64) + ReLU) + Linear head, batch {small_batch}: many small layers",
            lambda: _mlp(64, small_depth, classes),
            lambda g: (torch.randn(small_batch, 64, generator=g), labels(g, small_batch)),
        ),
        "gpt2": ModelSpec(
            "gpt2",
            f"GPT-2-like: Embedding({g_vocab},{g_d}) + position embedding + 2 blocks (4 heads, sdpa, GELU MLP) +"
            f" LayerNorm + Linear head, next-token loss, seq {g_seq}, batch {g_batch}",
            lambda: _GPT2(g_vocab, g_d, 4, 2, g_seq),
            lambda g: (
                torch.randint(0, g_vocab, (g_batch, g_seq), generator=g),
                torch.randint(0, g_vocab, (g_batch * g_seq,), generator=g),
            ),
        ),
    }


class _Batches(Dataset):
    """``length`` batches cycling through a few pre-generated ones: one epoch covers the whole fit."""

    def __init__(self, batches: list[tuple[Tensor, Tensor]], length: int) -> None:
        self.batches = batches
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.batches[index % len(self.batches)]


class Task(pl.LightningModule):
    """Cross-entropy classification of ``net``'s output, trained with Adam."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Cross-entropy of one batch."""
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam with default hyper-parameters."""
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def leaf_modules(root: nn.Module) -> dict[str, nn.Module]:
    """Leaf submodules of ``root`` by name (what ``LayerHealthCallback(layers=None)`` selects)."""
    return {name: m for name, m in root.named_modules() if name and next(m.children(), None) is None}


# ---------------------------------------------------------------------------------------------------- callbacks
class Step(NamedTuple):
    """One measured training step."""

    global_step: int
    wall: float
    """Seconds from this step's ``on_train_batch_start`` to the next one's."""
    cpu: float
    """Process CPU seconds (all threads) over the same interval."""
    hook: float
    """Seconds spent in the measured callback's batch-level methods during the step (LayerHealthCallback only)."""


_BATCH_METHODS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


class StepTimer(Callback):
    """Records ``(global_step, perf_counter_ns)`` at every batch start; listed first, so it starts first."""

    def __init__(self) -> None:
        self.starts: list[tuple[int, int]] = []
        self.cpu: list[int] = []
        self.hook_ns: list[int] = []
        """Time spent inside the wrapped batch-level methods of the measured callback, per step."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Stamp the start of a step (after the device's queued work: a step's kernels end inside it)."""
        if torch.cuda.is_available() and TRAINER_DEVICE["accelerator"] == "gpu":
            torch.cuda.synchronize()
        self.starts.append((trainer.global_step, time.perf_counter_ns()))
        self.cpu.append(time.process_time_ns())
        self.hook_ns.append(0)
        # The first host allocation after the optimizer step costs ~40 us on the CPU, whoever makes it: without this
        # one, the measured callback's first allocation would pay it and the forward would be as much shorter
        # (measured on mlp48: 41.7 us for a 5 KB torch.empty there, 1.6 us for the next; forward 50 us shorter).
        # Taken here, in every variant alike, the callback's own time excludes what training pays anyway.
        torch.empty(1024, dtype=torch.uint8)

    def time_methods(self, callback: Callback, names: tuple[str, ...]) -> None:
        """Shadow ``callback``'s methods with timed wrappers that add to the current step's ``hook_ns``."""
        for name in names:
            method = getattr(callback, name)

            def timed(*args: Any, _method: Callable[..., Any] = method, **kwargs: Any) -> Any:
                t0 = time.perf_counter_ns()
                try:
                    return _method(*args, **kwargs)
                finally:
                    if self.hook_ns:
                        self.hook_ns[-1] += time.perf_counter_ns() - t0

            setattr(callback, name, timed)

    def intervals(self) -> list[tuple[int, float]]:
        """``(global_step, seconds)`` of every step that has a following start."""
        return [(s0, (t1 - t0) * 1e-9) for (s0, t0), (_, t1) in zip(self.starts, self.starts[1:], strict=False)]

    def cpu_intervals(self) -> list[float]:
        """Process CPU seconds (all threads) of the same steps: a cross-check that is less sensitive to load."""
        return [(t1 - t0) * 1e-9 for t0, t1 in zip(self.cpu, self.cpu[1:], strict=False)]

    def steps(self) -> list[Step]:
        """Every step that has a following start."""
        return [
            Step(s, wall, cpu, hook * 1e-9)
            for (s, wall), cpu, hook in zip(self.intervals(), self.cpu_intervals(), self.hook_ns, strict=False)
        ]


class TutorialCallback(Callback):
    """Per-layer diagnostics as tutorials write them: always-on hooks, one ``.item()`` per layer and parameter."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self._handles: list[Any] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Hook every leaf module."""
        for name, module in leaf_modules(pl_module).items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
            self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))

    def _forward_hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, Tensor) and output.is_floating_point():
                self.values[f"act_std/{name}"] = output.detach().std().item()

        return hook

    def _backward_hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if grad_output[0] is not None:
                self.values[f"grad_norm/{name}"] = grad_output[0].norm().item()

        return hook

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Norm of every parameter's gradient."""
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                self.values[f"param_grad_norm/{name}"] = p.grad.norm().item()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class HookFloorCallback(Callback):
    """The library's own hook machinery on every leaf, every step, with sinks that do nothing or one ``sum``.

    ``hooks_noop`` prices observing at all (forward hooks, output tensor hooks, attach/remove); ``hooks_one_read``
    adds one read of every output and output gradient (the least any per-layer statistic needs). Neither computes
    parameter statistics, so ``params_only`` + ``hooks_one_read`` is a floor for ``every_step`` of any design that
    observes through hooks.
    """

    def __init__(self, read: bool) -> None:
        self.read = read
        self.sums: list[Tensor] = []
        self.hooks: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the hook set over every leaf module."""
        from lightning_hookdiag._hooks import HookSet, first_floating_tensor

        def read(index: int, output: Any) -> None:
            tensor = first_floating_tensor(output)
            if tensor is not None:
                self.sums.append(tensor.sum())

        sink = read if self.read else (lambda index, output: None)
        self.hooks = HookSet(leaf_modules(pl_module), sink, sink)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Attach, as a sampled step does."""
        self.hooks.attach()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        """Remove, and drop the sums."""
        self.hooks.remove()
        self.hooks.clear_order()
        self.sums.clear()


class ReplayEveryStep(LayerHealthCallback):
    """The sentinel trips on every step and replays it (no step is sampled): what one replay costs."""

    def __init__(self) -> None:
        super().__init__(every_n_steps=NEVER, on_anomaly="ignore", output={"summary": False})
        assert self._sentinel is not None
        check = self._sentinel.check

        def always(step: int, *args: Any, **kwargs: Any) -> Trip:
            check(step, *args, **kwargs)  # the real check's read, as on every step
            self._sentinel.previous_trip = None  # not a persisting failure: replay each time
            return Trip(step=step, kind="loss_spike", loss=1.0, baseline=1.0)

        self._sentinel.check = always  # type: ignore[method-assign]


def make_callback(variant: str, every_n_steps: int = 1) -> Callback | None:
    """The diagnostics callback of a variant (``None`` for ``plain``); ``every_n_steps`` for the sampling ones."""
    if variant == "plain":
        return None
    if variant == "every_step":
        return LayerHealthCallback(every_n_steps=every_n_steps)
    if variant == "tutorial_stats":
        return LayerHealthCallback(every_n_steps=every_n_steps, stats=TUTORIAL_STATS)
    if variant == "sentinel_only":
        return LayerHealthCallback(every_n_steps=NEVER)
    if variant == "default_interval":
        return LayerHealthCallback()
    if variant == "tutorial":
        return TutorialCallback()
    if variant in ("hooks_noop", "hooks_one_read"):
        return HookFloorCallback(read=variant == "hooks_one_read")
    if variant == "no_sentinel":
        return LayerHealthCallback(every_n_steps=NEVER, sentinel=None)
    if variant in ("sentinel_loss", "sentinel_grads"):
        return LayerHealthCallback(every_n_steps=NEVER, sentinel="loss" if variant == "sentinel_loss" else "loss+grads")
    if variant == "replay":
        return ReplayEveryStep()
    if variant == "opt_in":  # every statistic, the opt-in ones included, two precision targets
        stats = [*ALL_STATS, *OPT_IN_STATS]
        return LayerHealthCallback(
            every_n_steps=1, stats=stats, measure={"precision_targets": ["float16", "float8_e4m3fn"]}
        )
    if variant in ("fast_off", "fast_on"):  # every_step with the one-pass fast path off / on: both paths side by side
        return LayerHealthCallback(every_n_steps=1, measure={"fast_path": variant.removeprefix("fast_")})
    if variant == "precursors":  # every_step plus the attention and output-logit probes
        return LayerHealthCallback(every_n_steps=1, stats=[*ALL_STATS, *PRECURSOR_STATS])
    families = {"acts_only": ACTIVATION_STATS, "grads_only": GRADIENT_STATS, "params_only": PARAMETER_STATS}
    return LayerHealthCallback(every_n_steps=every_n_steps, stats=families[variant])


# --------------------------------------------------------------------------------------------------- op counts
_ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh"})
"""Ops that allocate without writing: no kernel launch on an accelerator."""
_HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "bincount"})
"""Ops whose result (or its shape) is read on the host: a device synchronisation on an accelerator."""


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched while active, per bucket (see :meth:`bucket`), split by what they cost.

    ``views`` (view ops, ``detach``, ``alias``) and ``allocations`` (``empty*``) launch no kernel; every other op
    launches at least one on an accelerator (``launching``). ``host_reads`` counts ops that read a value back to the
    host plus ``Tensor.tolist`` calls, which on a CPU tensor read memory without dispatching anything.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = "step"
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.calls: Counter[str] = Counter()

    @contextlib.contextmanager
    def bucket(self, name: str) -> Iterator[None]:
        """Count the ops dispatched inside the block under ``name`` (and count one call of it)."""
        previous, self.current = self.current, name
        self.calls[name] += 1
        try:
            yield
        finally:
            self.current = previous

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.counts[self.current][name] += 1
        return func(*args, **(kwargs or {}))

    def record_tolist(self) -> None:
        """Count one host read (``Tensor.tolist``) in the current bucket."""
        self.counts[self.current]["tolist"] += 1

    @staticmethod
    def kind(name: str) -> str:
        """``"views"``, ``"allocations"``, ``"host_reads"`` or ``"launching"`` for an aten op name."""
        if name in ("detach", "alias") or name in _VIEW_OPS:
            return "views"
        if name in _ALLOCATIONS:
            return "allocations"
        if name in _HOST_READS or name == "tolist":
            return "host_reads"
        return "launching"

    def summary(self, bucket: str) -> dict[str, int]:
        """Totals of ``bucket`` by kind, and ``all``."""
        out = dict.fromkeys(("all", "launching", "views", "allocations", "host_reads"), 0)
        for name, n in self.counts.get(bucket, Counter()).items():
            kind = self.kind(name)
            out[kind] += n
            if kind != "host_reads" or name != "tolist":
                out["all"] += n
            if kind == "host_reads" and name != "tolist":
                out["launching"] += n  # a copy back to the host is a launch too
        return out


_VIEW_OPS = frozenset(
    op.__name__
    for op in (getattr(torch.ops.aten, n) for n in dir(torch.ops.aten) if not n.startswith("_") or n == "_unsafe_view")
    if isinstance(op, torch._ops.OpOverloadPacket)
    and any(getattr(op, o).is_view for o in op.overloads() if hasattr(getattr(op, o), "is_view"))
)


def _sink_classes() -> tuple[Any, Any, Any]:
    # The recorder moved out of aggregation.py in issue 21: the counter also runs against the tree before it.
    try:
        from lightning_hookdiag._recorder import StepRecorder
    except ImportError:  # pragma: no cover - the tree before the move
        from lightning_hookdiag._aggregation import StepRecorder
    from lightning_hookdiag._params import ParameterTracker
    from lightning_hookdiag._sentinel import LossSentinel

    return StepRecorder, ParameterTracker, LossSentinel


@contextlib.contextmanager
def counting(counter: OpCounter) -> Iterator[None]:
    """Run with ``counter`` active, the package's entry points bucketed: output, grad, params, sentinel."""
    recorder, tracker, sentinel = _sink_classes()
    patches = [
        (recorder, "on_tensor" if hasattr(recorder, "on_tensor") else "on_output", "output"),
        (recorder, "on_grad", "grad"),
        (tracker, "before_step", "params"),
        (tracker, "after_step", "params"),
        (sentinel, "observe_loss", "sentinel"),
        (sentinel, "check", "sentinel"),
    ]
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, name in patches:
        method = getattr(owner, attr)

        @functools.wraps(method)
        def wrapped(*args: Any, _method: Callable[..., Any] = method, _name: str = name, **kwargs: Any) -> Any:
            with counter.bucket(_name):
                return _method(*args, **kwargs)

        setattr(owner, attr, wrapped)
    tolist = torch.Tensor.tolist

    def counted_tolist(self: Tensor) -> Any:
        counter.record_tolist()
        return tolist(self)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    try:
        with counter:
            yield
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        for owner, attr, method in originals:
            setattr(owner, attr, method)


class StepOps(Callback):
    """Snapshots the counter's ``step`` bucket and every other bucket at each batch start, per step."""

    def __init__(self, counter: OpCounter) -> None:
        self.counter = counter
        self.marks: list[tuple[int, dict[str, Counter[str]], Counter[str]]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Mark the start of a step."""
        snapshot = {k: Counter(v) for k, v in self.counter.counts.items()}
        self.marks.append((trainer.global_step, snapshot, Counter(self.counter.calls)))

    def per_step(self) -> list[tuple[int, dict[str, Counter[str]], Counter[str]]]:
        """``(step, ops per bucket, calls per bucket)`` of every step with a following start."""
        out = []
        for (step, before, calls0), (_, after, calls1) in zip(self.marks, self.marks[1:], strict=False):
            ops = {k: after[k] - before.get(k, Counter()) for k in after}
            out.append((step, ops, calls1 - calls0))
        return out


def _kinds(ops: dict[str, Counter[str]]) -> dict[str, int]:
    out = dict.fromkeys(("all", "launching", "views", "allocations", "host_reads"), 0)
    for counts in ops.values():
        for name, n in counts.items():
            kind = OpCounter.kind(name)
            out[kind] += n
            if name != "tolist":
                out["all"] += n
                if kind == "host_reads":
                    out["launching"] += n
    return out


def count_ops(spec: ModelSpec, batch: tuple[Tensor, Tensor], variant: str, steps: int = 6) -> dict[str, Any]:
    """Aten ops per step of ``variant`` (sampled every other step), per hooked tensor, per bucket.

    Returns a dict with ``sampled`` and ``unsampled`` (median op totals by kind over the steps of each kind, steps
    0 and 1 dropped as warm-up), ``per_output`` / ``per_grad`` (ops inside one output / gradient sink call by kind,
    averaged over the calls), ``params`` and ``sentinel`` (per optimizer step) and ``top_sampled`` (the most frequent
    launching ops of a sampled step).
    """
    torch.manual_seed(0)
    task = Task(spec.build())
    counter = OpCounter()
    marks = StepOps(counter)
    extra = make_callback(variant, every_n_steps=2)
    callbacks: list[Callback] = [marks] + ([extra] if extra is not None else [])
    with quiet(), counting(counter):  # findings on these synthetic models are not what is counted
        fit(task, [batch], steps + 1, callbacks)
    recorded = [r for r in marks.per_step() if r[0] >= 2]
    sampled = [r for r in recorded if r[0] % 2 == 0] if extra is not None else recorded
    unsampled = [r for r in recorded if r[0] % 2 == 1] if extra is not None else recorded

    def median_kinds(rows: list[tuple[int, dict[str, Counter[str]], Counter[str]]]) -> dict[str, float]:
        kinds = [_kinds(ops) for _, ops, _ in rows]
        return {k: _median([float(d[k]) for d in kinds]) for k in kinds[0]} if kinds else {}

    def per_call(bucket: str) -> dict[str, float]:
        calls = sum(c[bucket] for _, _, c in sampled)
        if not calls:
            return {}
        total: Counter[str] = Counter()
        for _, ops, _ in sampled:
            total += ops.get(bucket, Counter())
        kinds = _kinds({bucket: total})
        return {"calls_per_step": calls / len(sampled), **{k: v / calls for k, v in kinds.items()}}

    def per_step(bucket: str) -> dict[str, float]:
        rows = [{bucket: ops.get(bucket, Counter())} for _, ops, _ in sampled]
        kinds = [_kinds(r) for r in rows]
        return {k: _median([float(d[k]) for d in kinds]) for k in kinds[0]} if kinds else {}

    top: Counter[str] = Counter()
    for _, ops, _ in sampled:
        for counts in ops.values():
            top.update({n: c for n, c in counts.items() if OpCounter.kind(n) == "launching"})
    return {
        "sampled": median_kinds(sampled),
        "unsampled": median_kinds(unsampled),
        "per_output": per_call("output"),
        "per_grad": per_call("grad"),
        "params": per_step("params"),
        "sentinel": per_step("sentinel"),
        "top_sampled": [(n, c / max(len(sampled), 1)) for n, c in top.most_common(12)],
    }


COUNT_VARIANTS = (
    "plain",
    "tutorial",
    "every_step",
    "tutorial_stats",
    "acts_only",
    "grads_only",
    "params_only",
    "sentinel_only",
)


def run_count_ops(specs: dict[str, ModelSpec], models: list[str], seed: int) -> dict[str, Any]:
    """:func:`count_ops` of every :data:`COUNT_VARIANTS` entry on ``models``; prints one table per model."""
    results: dict[str, Any] = {}
    for model in models:
        batch = batches_for(specs[model], seed, count=1)[0]
        results[model] = {v: count_ops(specs[model], batch, v) for v in COUNT_VARIANTS}
        plain = results[model]["plain"]["sampled"]
        print(f"\nop counts {model} (aten ops per step; launching = not a view, detach or empty allocation)")
        print(f"  plain step: {plain['all']:.0f} ops, {plain['launching']:.0f} launching")
        header = "  variant          extra/sampled (all/launch)  extra/unsampled  extra host reads s/u"
        print(header + "   per output (all/launch)   per grad (all/launch)   params/step  sentinel/step")
        for variant, r in results[model].items():
            if variant == "plain":
                continue
            s, u = r["sampled"], r["unsampled"]
            po, pg = r["per_output"], r["per_grad"]
            print(
                f"  {variant:<16} {s['all'] - plain['all']:>8.0f} / {s['launching'] - plain['launching']:<8.0f}"
                f"     {u['all'] - plain['all']:>6.0f} / {u['launching'] - plain['launching']:<6.0f}"
                f"  {s['host_reads'] - plain['host_reads']:>8.0f} / {u['host_reads'] - plain['host_reads']:<8.0f}"
                f"  {po.get('all', 0):>7.1f} / {po.get('launching', 0):<6.1f} x{po.get('calls_per_step', 0):<5.0f}"
                f"  {pg.get('all', 0):>6.1f} / {pg.get('launching', 0):<6.1f} x{pg.get('calls_per_step', 0):<5.0f}"
                f"  {r['params'].get('launching', 0):>6.0f}  {r['sentinel'].get('launching', 0):>6.0f}"
            )
        top = ", ".join(f"{n} {c:.0f}" for n, c in results[model]["every_step"]["top_sampled"])
        print(f"  every_step, top launching ops of a sampled step (with training's own): {top}")
    return results


# ------------------------------------------------------------------------------------------------------ running
@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence Lightning's per-fit info lines and the advice it gives about tiny synthetic runs."""
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # num_workers, tiny runs, GPU available, ...
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        # The transformer's attention output projection is called functionally, never as a module: the callback
        # warns once that it did not run. That is expected here.
        warnings.simplefilter("ignore", LayerHealthWarning)
        try:
            yield
        finally:
            lightning_logger.setLevel(level)


def batches_for(spec: ModelSpec, seed: int, count: int = 4) -> list[tuple[Tensor, Tensor]]:
    """A few fixed synthetic batches."""
    g = torch.Generator().manual_seed(seed)
    return [spec.batch(g) for _ in range(count)]


def run_block(
    spec: ModelSpec, batches: list[tuple[Tensor, Tensor]], variant: str, steps: int, warmup: int, seed: int
) -> tuple[list[Step], Callback | None]:
    """Train a fresh model for ``warmup + steps`` steps; return the last ``steps`` of them and the callback."""
    torch.manual_seed(seed)
    task = Task(spec.build())
    timer = StepTimer()
    extra = make_callback(variant)
    if isinstance(extra, LayerHealthCallback):
        timer.time_methods(extra, _BATCH_METHODS)
    callbacks: list[Callback] = [timer] + ([extra] if extra is not None else [])
    fit(task, batches, warmup + steps + 1, callbacks)  # the last step has no following start
    return timer.steps()[warmup : warmup + steps], extra


def fit(task: pl.LightningModule, batches: list[tuple[Tensor, Tensor]], steps: int, callbacks: list[Callback]) -> None:
    """Train ``task`` for ``steps`` steps on ``batches`` (cycled) where ``--accelerator`` says, with nothing else on."""
    trainer = pl.Trainer(
        **TRAINER_DEVICE,
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=steps,
        callbacks=callbacks,
    )
    trainer.fit(task, train_dataloaders=DataLoader(_Batches(batches, steps), batch_size=None, shuffle=False))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(variant: str, times: list[Step], block: int) -> dict[str, Any]:
    """Median step time; for ``default_interval`` also the amortised cost per step over whole periods."""
    seconds = [t.wall for t in times]
    out: dict[str, Any] = {"steps": len(seconds), "median_ms": _median(seconds) * 1e3}
    out["mean_ms"] = statistics.fmean(seconds) * 1e3 if seconds else float("nan")
    out["median_cpu_ms"] = _median([t.cpu for t in times]) * 1e3
    out["median_hook_ms"] = _median([t.hook for t in times]) * 1e3
    out["step_ms"] = [round(t * 1e3, 3) for t in seconds]
    if variant == "default_interval":
        sampled = [t.wall for t in times if t.global_step % PERIOD == 0]
        unsampled = [t.wall for t in times if t.global_step % PERIOD]
        out["sampled_steps"] = len(sampled)
        out["sampled_median_ms"] = _median(sampled) * 1e3
        out["unsampled_median_ms"] = _median(unsampled) * 1e3
        out["amortised_ms"] = ((PERIOD - 1) * _median(unsampled) + _median(sampled)) / PERIOD * 1e3
        # Extra cost per step, from differences inside the same blocks (drift-free): the sampled step's excess over
        # the unsampled ones, spread over the period, plus the callback's own time on an unsampled step.
        out["unsampled_hook_ms"] = _median([t.hook for t in times if t.global_step % PERIOD]) * 1e3
        out["amortised_extra_ms"] = (_median(sampled) - _median(unsampled)) / PERIOD * 1e3 + out["unsampled_hook_ms"]
        # Whole periods: consecutive runs of PERIOD steps inside each block (blocks are multiples of PERIOD).
        periods = [
            statistics.fmean(seconds[i : i + PERIOD])
            for start in range(0, len(seconds), block)
            for i in range(start, start + block - PERIOD + 1, PERIOD)
        ]
        out["periods"] = len(periods)
        out["period_mean_ms"] = _median(periods) * 1e3
    return out


# -------------------------------------------------------------------------------------------------------- floor
def floor_bytes(spec: ModelSpec, batch: tuple[Tensor, Tensor], seed: int) -> dict[str, int]:
    """Bytes the statistics of one sampled step must read, from one pass with shape-recording hooks only."""
    torch.manual_seed(seed)
    task = Task(spec.build())
    modules = leaf_modules(task)
    sizes = {"activations": 0, "activation_grads": 0}

    def record(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, Tensor) and output.is_floating_point():
            nbytes = output.numel() * output.element_size()
            sizes["activations"] += nbytes
            if output.requires_grad:
                sizes["activation_grads"] += nbytes

    handles = [m.register_forward_hook(record) for m in modules.values()]
    try:
        task.training_step(batch, 0).backward()
    finally:
        for h in handles:
            h.remove()
    params = {id(p): p for m in modules.values() for p in m.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    sizes.update(weights=weights, grads=grads, snapshot=3 * weights)  # copy written, copy + new weights read back
    sizes["total"] = sum(sizes.values())
    return sizes


def time_read(nbytes: int, repeats: int) -> float:
    """Median seconds of one streaming read (``sum``) over a float32 buffer of ``nbytes``."""
    cuda = TRAINER_DEVICE["accelerator"] == "gpu"
    buffer = torch.ones(max(nbytes // 4, 1), device="cuda" if cuda else "cpu")
    buffer.sum()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        buffer.sum()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------------------ profile
class _Timers:
    """Inclusive wall-clock time and call counts of wrapped functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, attribute: str, label: str) -> Callable[[], None]:
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        setattr(owner, attribute, timed)
        return lambda: setattr(owner, attribute, original)


def profile_model(spec: ModelSpec, batches: list[tuple[Tensor, Tensor]], steps: int, seed: int) -> dict[str, Any]:
    """Break down the extra time of ``every_step`` sampled steps by component and by aten op."""
    from lightning_hookdiag import _aggregation as aggregation
    from lightning_hookdiag import _callback as callback
    from lightning_hookdiag import _diagnosis as diagnosis
    from lightning_hookdiag import _fit_run as fit_run
    from lightning_hookdiag import _hooks as hooks
    from lightning_hookdiag import _params as params
    from lightning_hookdiag import _recorder as recorder
    from lightning_hookdiag import _stats as stats

    timers = _Timers()
    targets = [
        (recorder.StepRecorder, "on_tensor", "recorder.on_tensor (forward sink, total)"),
        (recorder.StepRecorder, "on_grad", "recorder.on_grad (gradient sink, total)"),
        (stats, "activation_row", "  stats.activation_row"),
        (recorder, "activation_row", "  stats.activation_row"),  # the stacked small outputs: bound by the recorder
        (stats, "unit_maxima", "  stats.unit_maxima"),
        (stats, "gradient_row", "  stats.gradient_row"),
        (recorder, "gradient_row", "  stats.gradient_row"),
        (aggregation.LayerStatsAggregator, "update", "  LayerStatsAggregator.update body (no torchmetrics wrapper)"),
        (recorder.StepRecorder, "take", "  StepRecorder.take (the step's call rows to per-layer rows)"),
        (hooks, "first_floating_tensor", "hooks.first_floating_tensor (in the forward hook)"),
        (hooks.HookSet, "attach", "HookSet.attach"),
        (hooks.HookSet, "remove", "HookSet.remove"),
        (params.ParameterTracker, "before_step", "ParameterTracker.before_step"),
        (params.ParameterTracker, "after_step", "ParameterTracker.after_step"),
        (callback.LayerHealthCallback, "_finish", "callback._finish (rules, logging, heatmaps)"),
        (fit_run.FitRun, "collect", "FitRun.collect (pool, transfer, values)"),
        (aggregation.LayerStatsAggregator, "compute", "  LayerStatsAggregator.compute body (no torchmetrics wrapper)"),
        (callback.LayerHealthCallback, "_log", "  callback._log"),
        (diagnosis.Diagnosis, "step", "  Diagnosis.step (rules)"),
    ]
    restore = [timers.wrap(owner, attr, label) for owner, attr, label in targets]
    warmup = 3
    try:
        times, _ = run_block(spec, batches, "every_step", steps, warmup, seed)
        plain, _ = run_block(spec, batches, "plain", steps, warmup, seed)
    finally:
        for undo in reversed(restore):
            undo()
    total_steps = steps + warmup + 1  # every fit step was sampled, warm-up included
    components = {k: v / total_steps * 1e3 for k, v in timers.seconds.items()}
    calls = {k: v / total_steps for k, v in timers.calls.items()}

    # Op-level view: torch.profiler over a few sampled steps (its per-op overhead inflates small ops).
    torch.manual_seed(seed)
    task = Task(spec.build())
    cb = LayerHealthCallback(every_n_steps=1)
    n_prof = 3

    class _Profile(Callback):
        def __init__(self) -> None:
            self.prof: torch.profiler.profile | None = None

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, b: Any, i: int) -> None:
            if trainer.global_step == warmup:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self.prof is not None:
                self.prof.__exit__(None, None, None)

    prof_cb = _Profile()
    fit(task, batches, warmup + n_prof, [prof_cb, cb])
    ops = []
    if prof_cb.prof is not None:
        for e in sorted(prof_cb.prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]:
            per_step = e.self_cpu_time_total / 1e3 / n_prof
            ops.append({"op": e.key, "calls_per_step": e.count / n_prof, "self_ms_per_step": per_step})
    return {
        "every_step_median_ms": _median([t.wall for t in times]) * 1e3,
        "plain_median_ms": _median([t.wall for t in plain]) * 1e3,
        "components_ms_per_step": components,
        "calls_per_step": calls,
        "top_ops_every_step": ops,
    }


# --------------------------------------------------------------------------------------------------------- main
def library_fingerprint() -> str:
    """Short hash of the measured library's source, to tell which version of ``lightning_hookdiag`` ran."""
    import hashlib

    import lightning_hookdiag

    digest = hashlib.sha256()
    for path in sorted(Path(lightning_hookdiag.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "lightning": pl.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"also: {','.join(EXTRA_VARIANTS)}")
    p.add_argument("--steps", type=int, default=20, help="measured steps per block (default_interval: --period-steps)")
    p.add_argument("--period-steps", type=int, default=50, help="measured steps per default_interval block (x50)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of every block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results.json", help="where to write the results")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run (default: torch's)")
    p.add_argument("--quick", action="store_true", help="tiny models and few steps: a smoke test (1 thread)")
    p.add_argument("--profile", action="store_true", help="also break down the sampled-step overhead")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="where the fits train")
    p.add_argument("--precision", default="32-true", help="Trainer precision, e.g. 16-mixed or bf16-mixed")
    p.add_argument("--count-ops", action="store_true", help="only count aten ops per step and per hooked tensor")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.period_steps, args.rounds, args.warmup = 6, PERIOD, 1, 2
        # One thread: a 2-thread OpenMP team stalls badly on a machine whose other core is busy.
        args.threads = args.threads or 1
    args.period_steps = max(PERIOD, args.period_steps // PERIOD * PERIOD)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.models) - set(MODELS)) + sorted(
        set(args.variants) - set(DEFAULT_VARIANTS) - set(EXTRA_VARIANTS)
    )
    if unknown:
        p.error(f"unknown model(s)/variant(s): {unknown}")
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        p.error("--accelerator gpu: torch sees no CUDA device on this machine")
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")
    return args


def _fmt_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [f"{'model':<12} {'variant':<17} {'ms/step':>9} {'x plain':>8}  note", "-" * 100]
    for model, variants in results.items():
        base = variants["plain"]["median_ms"]
        for variant, r in variants.items():
            if variant == "default_interval":
                ms = base + r["amortised_extra_ms"]
                note = (
                    f"plain + amortised extra: sampled step +{r['sampled_median_ms'] - r['unsampled_median_ms']:.1f}"
                    f" ms over unsampled, /{PERIOD}, + {r['unsampled_hook_ms'] * 1e3:.0f} us callback per unsampled"
                    f" step; direct: period-mean {r['period_mean_ms'] / variants['plain']['mean_ms']:.3f}x"
                )
            else:
                ms = r["median_ms"]
                note = f"median of {r['steps']} steps"
                if r.get("median_hook_ms"):
                    note += f"; {r['median_hook_ms']:.1f} ms of it in the callback's batch-level methods"
            lines.append(f"{model:<12} {variant:<17} {ms:>9.2f} {ms / base:>8.3f}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table and write the JSON; return the results."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    TRAINER_DEVICE.update(accelerator=args.accelerator, precision=args.precision)
    specs = model_specs(args.quick)
    if args.count_ops:
        with quiet():
            counted = run_count_ops(specs, args.models, args.seed)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine_info(), "op_counts": counted}, indent=2) + "\n")
        return {"op_counts": counted}
    started = time.perf_counter()
    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    raw: dict[str, dict[str, list[Step]]] = {m: defaultdict(list) for m in args.models}
    sanity: dict[str, dict[str, int]] = {m: {} for m in args.models}
    floors: dict[str, dict[str, Any]] = {}
    profiles: dict[str, Any] = {}
    with quiet():
        batches = {m: batches_for(specs[m], args.seed + i) for i, m in enumerate(args.models)}
        for model in args.models:  # one-time costs (lazy initialisation, first fit of the process) off the record
            for variant in ("plain", "every_step"):
                run_block(specs[model], batches[model], variant, 2, 1, args.seed)
        for r in range(args.rounds):
            for model in args.models:
                order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
                for variant in order:
                    steps = args.period_steps if variant == "default_interval" else args.steps
                    times, cb = run_block(specs[model], batches[model], variant, steps, args.warmup, args.seed)
                    raw[model][variant] += times
                    if isinstance(cb, LayerHealthCallback):
                        sanity[model][variant] = len(cb.last_metrics)
                    elif isinstance(cb, TutorialCallback):
                        sanity[model][variant] = len(cb.values)
            print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)

        results = {
            m: {
                v: summarise(v, raw[m][v], args.period_steps if v == "default_interval" else args.steps)
                for v in args.variants
            }
            for m in args.models
        }
        for model in args.models:
            sizes = floor_bytes(specs[model], batches[model][0], args.seed)
            seconds = time_read(sizes["total"], repeats=5 if args.quick else 30)
            plain = results[model]["plain"]["median_ms"]
            floor: dict[str, Any] = {"bytes": sizes, "read_ms": seconds * 1e3}
            floor["read_GBps"] = sizes["total"] / seconds / 1e9
            if "every_step" in results[model]:
                overhead = results[model]["every_step"]["median_ms"] - plain
                floor["sampled_overhead_ms"] = overhead
                floor["overhead_over_floor"] = overhead / (seconds * 1e3)
            floors[model] = floor
        if args.profile:
            for model in args.models:
                profiles[model] = profile_model(specs[model], batches[model], 5 if args.quick else 10, args.seed)

    print(_fmt_table(results))
    print()
    for model, f in floors.items():
        b = f["bytes"]
        line = (
            f"floor {model:<12} {b['total'] / 2**20:7.1f} MiB (acts {b['activations'] / 2**20:.1f}, act grads"
            f" {b['activation_grads'] / 2**20:.1f}, weights {b['weights'] / 2**20:.1f}, grads {b['grads'] / 2**20:.1f},"
            f" snapshot {b['snapshot'] / 2**20:.1f}): read {f['read_ms']:.2f} ms ({f['read_GBps']:.1f} GB/s)"
        )
        if "sampled_overhead_ms" in f:
            line += f"; sampled overhead {f['sampled_overhead_ms']:.2f} ms = {f['overhead_over_floor']:.1f}x floor"
        print(line)
    for model, prof in profiles.items():
        every, plain = prof["every_step_median_ms"], prof["plain_median_ms"]
        print(f"\nprofile {model}: every_step {every:.2f} ms, plain {plain:.2f} ms (median of a short run)")
        for label, ms in prof["components_ms_per_step"].items():
            print(f"  {label:<62} {ms:8.3f} ms/step  {prof['calls_per_step'][label]:6.1f} calls/step")
        print("  top aten ops (self CPU, torch.profiler, every_step):")
        for op in prof["top_ops_every_step"][:15]:
            print(f"    {op['op']:<40} {op['self_ms_per_step']:8.3f} ms/step {op['calls_per_step']:7.1f} calls/step")

    payload = {
        "machine": machine_info(),
        "load_average_at_start": load_at_start,
        "library_sha256": library_fingerprint(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "models": {m: specs[m].description for m in args.models},
        "results": results,
        "floor": floors,
        "sanity_logged_values": sanity,
        "profile": profiles,
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {path} ({payload['wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
