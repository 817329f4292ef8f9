"""A real fit, small: tiny LightningModules, an in-memory Lightning logger, a Trainer factory, hook counting, and
trips injected through the sentinel's public detector seam."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import SentinelConfig
from lightning_hookdiag._sentinel import SpikeDetector

from .keys import by_name

# One thread, as conftest sets for the test session: the multi-process workers import these helpers, not conftest.
torch.set_num_threads(1)


def count_hooks(root: nn.Module) -> int:
    """Every module-level hook registered anywhere in ``root`` (forward, pre-forward, backward)."""
    total = 0
    for m in root.modules():
        total += len(m._forward_hooks) + len(m._forward_pre_hooks)
        total += len(m._backward_hooks) + len(m._backward_pre_hooks)
    total += len(torch.nn.modules.module._global_forward_hooks)
    return total


class RecordingLogger(Logger):
    """A real Lightning ``Logger`` that keeps every ``log_metrics`` call in memory.

    ``raw`` holds the calls as logged; ``calls`` the same calls :func:`by_name` (``<prefix>/<stat>/<name>``), so that
    a test reads a value by statistic and layer name; :meth:`ours` the statistics of those calls only.
    """

    def __init__(self) -> None:
        super().__init__()
        self.raw: list[tuple[int | None, dict[str, float]]] = []
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.raw.append((step, dict(metrics)))
        self.calls.append((step, by_name(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def ours(self, prefix: str = "layer_health") -> list[tuple[int | None, dict[str, float]]]:
        """The calls that carry this package's statistics, with those keys only, read :func:`by_name`.

        That is what :attr:`LayerHealthCallback.last_metrics` holds for the step (by name): every ``<prefix>/...``
        key but the count of active alerts logged in the same call (``<prefix>/alerts_active``), which the tests of
        the findings read from :attr:`calls` or :attr:`raw`.
        """
        head, count = prefix + "/", prefix + "/alerts_active"  # the count of active alerts (docs: #keys)
        out = []
        for step, metrics in self.calls:
            kept = {k: v for k, v in metrics.items() if k.startswith(head) and k != count}
            if kept:
                out.append((step, kept))
        return out


def make_data(n: int = 32, d_in: int = 4, d_out: int = 1, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g))


class TinyModule(pl.LightningModule):
    """A LightningModule around ``self.model`` that records, per training batch, the step, input and weights.

    The record is test instrumentation only: it lets a test recompute every statistic independently from the exact
    weights and inputs the Trainer used.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        data: TensorDataset | None = None,
        batch_size: int = 8,
        lr: float = 0.1,
        optimizer: str = "sgd",
    ) -> None:
        super().__init__()
        self.model = model if model is not None else nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.data = data if data is not None else make_data()
        self.batch_size = batch_size
        self.lr = lr
        self.optimizer_name = optimizer
        self.record: list[tuple[int, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
        self.record_enabled = True
        self.on_step: Callable[[TinyModule, int], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.on_step is not None:
            self.on_step(self, batch_idx)
        if self.record_enabled:
            weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.record.append((self.global_step, x.clone(), y.clone(), weights))
        return self.loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)

    def reference_model(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        """A copy of the model holding ``weights`` (the weights a recorded batch saw)."""
        ref = copy.deepcopy(self.model)
        ref.load_state_dict(weights)
        return ref


def make_trainer(callbacks: list[pl.Callback], max_steps: int = 4, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "max_steps": max_steps,
    }
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


@dataclass(eq=False)
class ForcedSpikes(SpikeDetector):
    """The sentinel's spike test with its defaults, which also calls a spike on ``steps`` (their losses stay healthy).

    A trip injected through the public detector seam (``SentinelConfig(detector=...)``): the losses still enter the
    baseline as they would without it, so that what the rest of the fit computes is unchanged.
    """

    steps: frozenset[int] = frozenset()

    def observe(self, loss: float, step: int | None = None) -> bool:
        spike = super().observe(loss, step)
        return spike or step in self.steps


def force_trips(steps: set[int], mode: str = "loss") -> SentinelConfig:
    """A ``sentinel=`` that trips (a loss spike) on ``steps`` without changing what training computes."""
    return SentinelConfig(mode=mode, detector=ForcedSpikes(steps=frozenset(steps)))
