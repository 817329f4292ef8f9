"""Shared test helpers: hook counting, an in-memory logger, tiny LightningModules, a Trainer factory, forced trips."""

from __future__ import annotations

import copy
import csv
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import SentinelConfig
from lightning_hookdiag.keys import ALERTS_ACTIVE, parse_key, step_key
from lightning_hookdiag.rules import (
    BUILTIN_RULES,
    Baseline,
    Finding,
    Memory,
    Observed,
    Rule,
    RuleConfig,
    evaluate,
)
from lightning_hookdiag.sentinel import SpikeDetector
from lightning_hookdiag.trends import History
from lightning_hookdiag.vocabulary import PER_PARAMETER_STATS


def run_rules(
    values: Mapping[str, Mapping[str, float]],
    forward_order: Sequence[str] = (),
    backward_order: Sequence[str] = (),
    step: int = 0,
    config: RuleConfig | None = None,
    *,
    baseline: Baseline | None = None,
    last_finite: Mapping[str, int] | None = None,
    history: History | None = None,
    rules: Sequence[Rule] = BUILTIN_RULES,
    **facts: Any,
) -> list[Finding]:
    """``evaluate`` on a step made of ``values``, its orders and ``facts`` (by name), with the memory given."""
    observed = Observed(step, values, {"forward_order": forward_order, "backward_order": backward_order, **facts})
    memory = Memory(baseline, last_finite or {}, history)
    return evaluate(observed, memory, config, rules=rules)


def count_hooks(root: nn.Module) -> int:
    """Every module-level hook registered anywhere in ``root`` (forward, pre-forward, backward)."""
    total = 0
    for m in root.modules():
        total += len(m._forward_hooks) + len(m._forward_pre_hooks)
        total += len(m._backward_hooks) + len(m._backward_pre_hooks)
    total += len(torch.nn.modules.module._global_forward_hooks)
    return total


def by_name(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with each per-layer key read back as ``<prefix>/<stat>/<name>``, for tests that look a value up by
    statistic and layer name; the summary group and every other key stay as they are.

    The logged layout (``<prefix>.<stat>/<depth>_<name>``, ``docs/statistics.md#keys``) is checked on the keys as
    logged in ``tests/integration/test_keys.py``; the depth part is read with the package's parser.
    """
    out = {}
    for key, value in metrics.items():
        head = key.partition("/")[0]
        prefix, dot, _ = head.rpartition(".")
        parsed = parse_key(key, prefix) if dot and prefix else None
        if parsed is not None and parsed.name is not None:
            out[f"{prefix}/{parsed.stat}/{parsed.name}"] = value
        else:
            out[key] = value
    return out


def csv_statistic(run_dir: Path, stat: str, prefix: str = "layer_health") -> dict[int, dict[str, float]]:
    """``{step: {layer: value}}`` of one per-layer statistic, read back from a CSVLogger run's ``metrics.csv``."""
    out: dict[int, dict[str, float]] = {}
    with open(run_dir / "metrics.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            for key, cell in row.items():
                parsed = parse_key(key, prefix)
                if parsed is not None and parsed.stat == stat and parsed.name is not None and cell != "":
                    out.setdefault(int(row["step"]), {})[parsed.name] = float(cell)
    return out


def offline_wandb_logger(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``WandbLogger`` writing an offline run under ``save_dir``, with W&B's own folders there too, quietly.

    End it with :func:`finish_wandb` before reading the run's files.
    """
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(save_dir / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = wandb.Settings(
        disable_git=True, disable_code=True, console="off", x_disable_stats=True, x_disable_meta=True
    )
    return WandbLogger(save_dir=str(save_dir), offline=True, project="hookdiag", settings=settings)


def finish_wandb() -> None:
    """End the W&B run and wait until its file is written: offline, ``finish()`` can return before the service
    process has written it; ``teardown()`` waits for the service to shut down (it starts again on the next init)."""
    import wandb

    wandb.finish()
    wandb.teardown()


def depths(metrics: dict[str, float], prefix: str = "layer_health") -> dict[str, int]:
    """The depth (place in the forward order) that each layer's keys in ``metrics`` carry, read with the package's
    parser; parameters' keys (which carry their module's depth) are left out."""
    out = {}
    for key in metrics:
        parsed = parse_key(key, prefix)
        if parsed is None or parsed.name is None or parsed.depth is None or parsed.stat in PER_PARAMETER_STATS:
            continue
        out[parsed.name] = parsed.depth
    return out


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
        head, count = prefix + "/", step_key(prefix, ALERTS_ACTIVE)
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


# The models here are tiny: one thread avoids oversubscribing the 2 cores of CI (and of developer machines, where
# other jobs run beside the tests) and is faster than two for such sizes.
torch.set_num_threads(1)


def pytest_configure() -> None:
    # Subprocesses (the multi-process workers, the examples, the CLI) import the package from this checkout, as the
    # tests do, not whichever copy is installed (an editable install may point at another worktree).
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


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


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` imported as a module (benchmarks/ is no package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while defining
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module
