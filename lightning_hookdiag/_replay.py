"""The Lightning side of an optimizer step: what the engine (:class:`~lightning_hookdiag._fit_run.FitRun`) asks of it.

:class:`LightningStep` answers with the Trainer's loss scale, whether its step can be replayed, and a micro-batch's
``training_step`` run again under the Trainer's precision context and gradient scaling. With the callback and the
logger writers, the only module that imports Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import strategies
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn

from lightning_hookdiag._optimizer_watch import Schedule
from lightning_hookdiag._rerun import MicroBatch

__all__ = ["LightningStep", "sharded"]


def sharded(trainer: pl.Trainer, params: Mapping[str, nn.Parameter]) -> bool:
    """Whether each process holds only a shard of the parameters (FSDP, FSDP2 / ModelParallel, DTensor).

    Sharded parameters' local sums of squares add up across processes; replicated ones (DDP) must not be added.
    """
    if any(callable(getattr(p, "to_local", None)) for p in params.values()):
        return True
    return isinstance(trainer.strategy, (strategies.FSDPStrategy, strategies.ModelParallelStrategy))


def _replay_blocker(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why the Trainer's step cannot be re-run before the optimizer applies it, or ``None``."""
    if not pl_module.automatic_optimization:
        return "of manual optimization: training_step steps the optimizer itself, so it cannot be re-run"
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        return (
            "training_step takes dataloader_iter: it draws its batches from the loader itself, so the callback never"
            " holds the step's batch to run it again"
        )
    strategy = trainer.strategy
    replayable = (strategies.SingleDeviceStrategy, strategies.DDPStrategy)
    if not isinstance(strategy, replayable) or isinstance(strategy, strategies.DeepSpeedStrategy):
        return (
            f"the {type(strategy).__name__} strategy is not replayed: outside its wrapper a replay could"
            " communicate or write gradients (FSDP's backward reduce-scatters into .grad)"
        )
    if sharded(trainer, dict(pl_module.named_parameters())):
        return "the parameters are sharded (DTensor): a replay could communicate or write gradients"
    return None


@contextmanager
def _logging_silenced(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` record nothing inside the block (a replayed ``training_step``).

    Instance attributes shadow the methods. The user's own instance attributes of those names (a wrapper, a partial,
    a mock) are shadowed as well and put back afterwards, exactly: only names that had none are deleted.
    """

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    names = ("log", "log_dict")
    own = {name: pl_module.__dict__[name] for name in names if name in pl_module.__dict__}
    pl_module.__dict__.update(dict.fromkeys(names, ignore))
    try:
        yield
    finally:
        for name in names:
            if name in own:
                pl_module.__dict__[name] = own[name]
            else:
                pl_module.__dict__.pop(name, None)


def _schedule(trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> Schedule:
    """How the Trainer steps ``optimizer``'s LR scheduler (:data:`~lightning_hookdiag._optimizer_watch.Schedule`).

    Manual optimization: no interval. The clock is the Trainer's for that interval, the optimizer step (``"step"``)
    or the epoch (``"epoch"``); the identity tells a scheduler swapped in by a callback (SWA) from the one before.
    """
    for config in trainer.lr_scheduler_configs:
        if getattr(config.scheduler, "optimizer", None) is optimizer:
            steps = getattr(config.scheduler, "last_epoch", None)
            interval = config.interval if pl_module.automatic_optimization else None
            clock = trainer.current_epoch if interval == "epoch" else trainer.global_step
            return interval, steps if isinstance(steps, int) else None, clock, id(config.scheduler)
    return None, None, None, None


@dataclass(frozen=True)
class LightningStep:
    """The Trainer's side of an optimizer step, as :class:`~lightning_hookdiag._fit_run.TrainingLoop` asks for it."""

    trainer: pl.Trainer
    pl_module: pl.LightningModule

    def loss_scale(self) -> Tensor | None:
        """The precision plugin's ``GradScaler`` scale, or ``None``."""
        scale = getattr(getattr(self.trainer.precision_plugin, "scaler", None), "_scale", None)
        return scale if isinstance(scale, Tensor) else None

    def replay_blocker(self) -> str | None:
        """Why the Trainer's step cannot be re-run before the optimizer applies it, or ``None``."""
        return _replay_blocker(self.trainer, self.pl_module)

    def micro_batch_loss(self, micro: MicroBatch) -> Tensor | None:
        """``training_step`` on ``micro`` again, its loss as the automatic-optimization loop back-propagates it.

        The LightningModule itself, not the DDP wrapper: DDP's reducer must not see this backward. What it logs is
        dropped.
        """
        trainer, pl_module = self.trainer, self.pl_module
        takes_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
        args = (micro.batch, micro.batch_idx) if takes_index else (micro.batch,)
        with trainer.precision_plugin.train_step_context(), _logging_silenced(pl_module):
            output = pl_module.training_step(*args)
        value = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(value, Tensor):
            return None
        value = value / trainer.accumulate_grad_batches
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return scaler.scale(value) if scaler is not None else value

    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """The Trainer's optimizers."""
        return self.trainer.optimizers

    def holds_parameters(self) -> bool:
        """``False`` under DeepSpeed, whose optimizers hold copies of the parameters."""
        return not isinstance(self.trainer.strategy, strategies.DeepSpeedStrategy)

    def schedule(self, optimizer: torch.optim.Optimizer) -> Schedule:
        """How the Trainer steps ``optimizer``'s LR scheduler and how often it has."""
        return _schedule(self.trainer, self.pl_module, optimizer)
