"""The replay of a tripped step (``docs/sentinel.md#the-replay``): its micro-batches run again through the hooks.

Run with the RNG state each micro-batch started with, leaving no trace: ``.grad``, buffers, RNG streams, torchmetrics
states and in-place writes are put back. Nothing here knows Lightning (the engine hands over a function that runs one
micro-batch), the sentinel's test, the rules or logging.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy  # a dependency of torchmetrics
import torch
from torch import Tensor, nn

from lightning_hookdiag._hooks import HookSet
from lightning_hookdiag._inplace import REPLAY_SAVE_BYTES, InPlaceGuard
from lightning_hookdiag._provenance import NonFiniteTrace
from lightning_hookdiag.components import call_all

__all__ = ["MicroBatch", "RngState", "capture_rng", "replay_step", "restore_rng"]

RngState = tuple[Tensor, Tensor | None]


def capture_rng(device: torch.device) -> RngState:
    """The CPU generator's state and, on CUDA, the device generator's (host-side copies; no device sync)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def restore_rng(state: RngState, device: torch.device) -> None:
    """Set the generators to a state from :func:`capture_rng`."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclass(frozen=True)
class MicroBatch:
    """A reference to one micro-batch of the current optimizer step, with the RNG state it started with."""

    batch: Any
    batch_idx: int
    rng: RngState


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def replay_step(
    micro_batches: Iterable[MicroBatch],
    run: Callable[[MicroBatch], Tensor | None],
    module: nn.Module,
    hooks: HookSet,
    device: torch.device,
    trace: NonFiniteTrace | None = None,
    budget: int = REPLAY_SAVE_BYTES,
) -> int:
    """Re-run one optimizer step's micro-batches through ``hooks``; returns how many produced a loss.

    Each micro-batch starts from the RNG state it started with; the gradient of its loss (``run`` returns ``None`` for
    a skipped one) goes back through the hooked outputs with ``torch.autograd.grad``, never into ``.grad``. ``hooks``
    (told the end of each micro-batch) and ``trace`` (read its ``origin`` afterwards) are attached for the replay and
    removed after it, also when ``run`` raises; the RNG streams (torch's CPU and ``device``'s, Python's, NumPy's) and
    the torchmetrics states of ``module`` are then as they were, and so is every tensor of ``module`` that the replay
    wrote in place or rebound (parameters, buffers, gradients, plain tensor attributes: a mean teacher's EMA update):
    :class:`~lightning_hookdiag._inplace.InPlaceGuard` copies at most ``budget`` bytes of them before their first write,
    and refuses a write beyond with :class:`~lightning_hookdiag._inplace.ReplayWriteLimit`, before it happens.

    Raises:
        ReplayWriteLimit: The replay would have written into more than ``budget`` bytes of ``module``'s tensors.
        RuntimeError: A tensor of ``module`` was written in place by a kernel that no op reported (its version
            counter moved), so it could not be put back.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
        >>> seen = []
        >>> hooks = HookSet({"0": net[0]}, lambda i, out: seen.append(out.sum().item()))
        >>> mb = MicroBatch(torch.ones(3, 2), 0, capture_rng(torch.device("cpu")))
        >>> replay_step([mb], lambda m: net(m.batch).sum(), net, hooks, torch.device("cpu"))
        1
        >>> len(seen), net[0].weight.grad is None, hooks.attached
        (1, True, False)
    """
    from torchmetrics import Metric

    params = [p for p in module.parameters() if p.requires_grad]
    rng, python_state, numpy_state = capture_rng(device), random.getstate(), numpy.random.get_state()
    guard = InPlaceGuard(module, budget)
    missed: list[str] = []
    metrics: list[tuple[Metric, dict[str, Any]]] = []
    for m in module.modules():
        if isinstance(m, Metric):
            state = {name: _clone(value) for name, value in m.metric_state.items()}
            metrics.append((m, {**state, "_update_count": m._update_count, "_computed": m._computed}))
    produced = 0
    try:
        with torch.enable_grad(), guard:
            hooks.attach()
            if trace is not None:
                trace.attach()
            for micro in micro_batches:
                restore_rng(micro.rng, device)
                loss = run(micro)
                if loss is not None:
                    produced += 1
                    if loss.requires_grad and params:
                        torch.autograd.grad(loss, params, allow_unused=True)
                del loss
                hooks.end_micro_batch()  # its backward is over: the companions keep its measurement
    finally:
        try:
            call_all([hooks.remove] if trace is None else [trace.remove, hooks.remove])
        finally:  # also when a companion's remove raised: the replay leaves no trace in the training state
            # The random streams first: they cannot fail to be put back.
            restore_rng(rng, device)
            random.setstate(python_state)
            numpy.random.set_state(numpy_state)
            missed = guard.restore()
            for metric, saved_state in metrics:
                for name, value in saved_state.items():
                    setattr(metric, name, value)
    if missed:
        raise RuntimeError(
            f"training_step changed {', '.join(missed)} in place without an op reporting the write (a kernel that"
            " bypasses the dispatcher), so the replay could not put it back"
        )
    return produced
