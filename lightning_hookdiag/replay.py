"""The Lightning side of a trip: whether the Trainer's step can be replayed, and the replay or trace of it.

:func:`~lightning_hookdiag.step_state.plan_trip` decides what a trip calls for; :func:`respond` does it with the
Trainer's own ``training_step``, precision context and gradient scaling, through
:func:`~lightning_hookdiag.sentinel.replay_step`. With the callback, the only module that imports Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import strategies
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn

from lightning_hookdiag.distributed import all_reduce_max
from lightning_hookdiag.fit_run import FitRun
from lightning_hookdiag.hooks import HookSet
from lightning_hookdiag.inplace import ReplayWriteLimit
from lightning_hookdiag.provenance import NonFiniteTrace, nonfinite_in_batch
from lightning_hookdiag.sentinel import MicroBatch, replay_step
from lightning_hookdiag.step_state import Trip, plan_trip

__all__ = ["respond", "sharded"]


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


def respond(
    trip: Trip,
    previous: int | None,
    traces: bool,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    run: FitRun,
    last_metrics: Mapping[str, float],
) -> Trip:
    """Carry out :func:`~lightning_hookdiag.step_state.plan_trip`'s plan for ``trip``; returns the trip to record.

    Every plan but ``"record"`` leaves a window of the step open. ``previous``: the sentinel's trip before this one;
    ``traces``: the rules read where its NaN/Inf was made; ``last_metrics``: the last logged values (a new window's
    kurtosis shift).
    """
    step, micro = trip.step, run.state.micro
    sampled, blocker = run.state.open_for(step) is not None, _replay_blocker(trainer, pl_module)
    plan = plan_trip(trip, sampled=sampled, traces=traces, blocker=blocker, previous=previous, held=micro.holds(step))
    trace = NonFiniteTrace(pl_module) if plan.trace or plan.action == "trace" else None
    if plan.action == "replay":  # into a new window; the hook set attaches the components that watch replays
        run.open_window(step, last_metrics)
        failure = _rerun(trainer, pl_module, run, run.hooks, trace)
        # Every process must agree, or the pooled statistics' collectives would not match.
        if all_reduce_max(torch.tensor([float(failure is not None)], device=pl_module.device)).item() > 0:
            run.discard_window()
            trace, failure = None, failure or "the replay failed on another process"
            plan = plan_trip(trip, sampled=False, traces=traces, blocker=failure, previous=previous, held=True)
    elif plan.action == "trace":
        # The hooks saw the step as it happened but cannot see functional code between two layers; still attached
        # (batch end removes them), they must not count the re-run through the trace alone.
        run.end_micro_batch()
        if _rerun(trainer, pl_module, run, HookSet({}, None), trace) is not None:
            trace = None  # the finding keeps what the hooks saw
    if plan.action == "parameters":
        run.open_window(step, last_metrics, layers=False)  # the parameters can still be measured
        run.state.sample_next = step + 1
    entry, origin = trace.origin(run.layer_names) if trace is not None else (None, None)
    recorded = replace(plan.trip, nan_entry=entry, nan_origin=origin)
    if plan.read_batch:  # data that arrives non-finite (a division by a zero std) is named as such; one read
        recorded = replace(recorded, bad_batch=tuple(nonfinite_in_batch([m.batch for m in micro.batches])))
    return recorded


def _rerun(
    trainer: pl.Trainer, pl_module: pl.LightningModule, run: FitRun, hooks: HookSet, trace: NonFiniteTrace | None
) -> str | None:
    """Run the step's micro-batches again through ``hooks`` and ``trace``; why it raised, or ``None``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    takes_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)

    def loss(micro: MicroBatch) -> Tensor | None:  # as the automatic-optimization loop back-propagates it
        args = (micro.batch, micro.batch_idx) if takes_index else (micro.batch,)
        # The LightningModule itself, not the DDP wrapper: DDP's reducer must not see this backward.
        with trainer.precision_plugin.train_step_context(), _logging_silenced(pl_module):
            output = pl_module.training_step(*args)
        value = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(value, Tensor):
            return None
        value = value / trainer.accumulate_grad_batches
        return scaler.scale(value) if scaler is not None else value

    try:
        replay_step(run.state.micro.batches, loss, pl_module, hooks, pl_module.device, trace)
    except ReplayWriteLimit as error:  # refused before the write; the writes before it were undone
        return f"{error}; the replay stopped there and undid its earlier writes"
    except Exception as error:  # reported in the finding; training goes on untouched
        return f"the replay raised {type(error).__name__}: {error}"
    return None
