"""The always-on sentinel: a cheap per-step trip test, and the replay of a tripped step without side effects.

Sampled steps are rare (one in ``every_n_steps``), and the failure a user wants named usually happens between two of
them; by the next sampled step the optimizer has spread it into every weight. The sentinel therefore looks at every
optimizer step, but only at what is cheap to look at:

* every micro-batch's loss, accumulated on the device (one small op per micro-batch, no host read);
* with ``"loss+grads"``, the largest ``|g|`` of the tracked parameters' accumulated gradients, in one fused
  ``_foreach_norm(inf)`` (an infinity norm cannot overflow, so only NaN/Inf trips it);
* once per optimizer step, everything is packed into one small tensor, reduced with one MAX all-reduce under
  multi-process training (so every process trips together, and the same step), and read to the host once.

A step trips when its loss or gradients are non-finite, or when its loss spikes: it rises far above a robust
baseline of recent steps (:class:`SpikeDetector`). On a trip the caller can *replay* the step: :func:`replay_step`
re-runs the step's micro-batches, with the weights still those the step's forward used, through a
:class:`~lightning_hookdiag.hooks.HookSet`, restoring afterwards everything the replay could have changed (random
number streams, buffers such as BatchNorm running statistics, torchmetrics states). Gradients are computed with
``torch.autograd.grad``, which returns them instead of accumulating them into ``.grad``.

This module knows nothing about Lightning (the callback hands it a function that runs one micro-batch) nor about
rules or logging.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_hookdiag.distributed import all_reduce_packed
from lightning_hookdiag.hooks import HookSet
from lightning_hookdiag.params import stored_values

__all__ = [
    "SENTINEL_MODES",
    "LossSentinel",
    "MicroBatch",
    "SpikeDetector",
    "Trip",
    "replay_step",
]

SENTINEL_MODES: tuple[str, ...] = ("loss", "loss+grads")
"""Values of the callback's ``sentinel`` argument besides ``None``."""

TripKind = Literal["nonfinite_loss", "nonfinite_grad", "loss_spike"]


@dataclass(frozen=True)
class Trip:
    """What the sentinel saw on the optimizer step it tripped on.

    Attributes:
        step: The optimizer step.
        kind: ``"nonfinite_loss"``, ``"nonfinite_grad"`` (only with ``"loss+grads"``) or ``"loss_spike"``.
        loss: The step's loss (the sum of its micro-batch losses as Lightning back-propagates them, i.e. their mean;
            the largest over processes); NaN when not finite.
        baseline: Median loss of the recent healthy steps the spike test compares against; ``None`` if unknown.
        last_finite_step: The last earlier step whose loss (and, with ``"loss+grads"``, gradients) was finite.
        replayed: Whether the step's statistics come from hooks (a replay, or a step that was sampled anyway).
        reason: Why the step was not replayed (empty when it was).
    """

    step: int
    kind: TripKind
    loss: float
    baseline: float | None = None
    last_finite_step: int | None = None
    replayed: bool = False
    reason: str = ""


class SpikeDetector:
    """Robust loss-spike test: a rise far above the median of recent healthy steps, in units of their spread.

    Positive losses (nearly every loss) are compared on a log scale, where healthy mini-batch noise is roughly the
    same size whatever the loss level, so a converged run with a tiny loss does not trip on a relatively noisy batch.
    A loss trips when it exceeds the window's median by more than ``zscore`` robust standard deviations
    (``1.4826 * MAD``) *and* by more than a factor ``ratio``. Losses that are zero or negative (some likelihoods)
    use the same test on a linear scale, with ``(ratio - 1) * |median|`` as the minimum rise.

    Both conditions are needed: the spread alone trips on a loss that was almost constant, the ratio alone on a
    noisy one. The window fills only with steps that did not trip, and nothing trips during the first ``warmup``
    steps it has seen.

    Args:
        window: Number of recent healthy losses kept.
        warmup: Healthy losses needed before anything can trip.
        zscore: Minimum rise in robust standard deviations.
        ratio: Minimum rise as a factor of the median (positive losses) or of ``|median|``.

    Example:
        >>> detector = SpikeDetector(window=50, warmup=5, zscore=8.0, ratio=10.0)
        >>> [detector.observe(loss) for loss in (1.0, 0.9, 1.1, 0.95, 1.05)]
        [False, False, False, False, False]
        >>> detector.median()
        1.0
        >>> detector.observe(2.0), detector.observe(1e8)  # noise is recorded; the spike is not
        (False, True)
    """

    def __init__(self, window: int = 50, warmup: int = 20, zscore: float = 8.0, ratio: float = 10.0) -> None:
        self.window = window
        self.warmup = warmup
        self.zscore = zscore
        self.ratio = ratio
        self.losses: deque[float] = deque(maxlen=window)
        # Logs are taken once, when a loss enters the window (the test runs on every optimizer step); NaN stands for
        # the log of a loss <= 0, and while one is in the window the linear scale is used.
        self._logs: deque[float] = deque(maxlen=window)
        self._nonpositive = 0

    def median(self) -> float | None:
        """Median of the healthy losses in the window; ``None`` when it is empty."""
        return _median(list(self.losses)) if self.losses else None

    def is_spike(self, loss: float) -> bool:
        """Whether ``loss`` (finite) is a spike against the window, without recording it."""
        if len(self.losses) < max(self.warmup, 1):
            return False
        positive = loss > 0 and not self._nonpositive
        if positive and loss * (1 + 1e-9) < self.ratio * min(self.losses):
            # The median is at least the window's minimum, so the rise is below log(ratio): the common case, decided
            # without the two sorts (31 -> 4 us per optimizer step measured inside training).
            return False
        history = list(self._logs) if positive else list(self.losses)
        centre = _median(history)
        spread = 1.4826 * _median([abs(v - centre) for v in history])
        if positive:
            rise = math.log(loss) - centre
            return rise > self.zscore * spread and rise > math.log(self.ratio)
        rise = loss - centre
        return rise > self.zscore * spread and rise > (self.ratio - 1) * abs(centre)

    def clear(self) -> None:
        """Empty the window."""
        self.losses.clear()
        self._logs.clear()
        self._nonpositive = 0

    def record(self, loss: float) -> None:
        """Add a healthy loss to the window."""
        if len(self.losses) == self.window and self.losses[0] <= 0:
            self._nonpositive -= 1  # about to leave the window
        self.losses.append(loss)
        self._logs.append(math.log(loss) if loss > 0 else math.nan)
        self._nonpositive += loss <= 0

    def observe(self, loss: float) -> bool:
        """Test ``loss`` and record it as healthy if it did not trip; returns whether it tripped."""
        spike = self.is_spike(loss)
        if not spike:
            self.record(loss)
        return spike


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


ReduceMax = Callable[[Tensor], Tensor]
"""Reduces a tensor with MAX over every process (the identity in a single process)."""


def all_reduce_max(t: Tensor) -> Tensor:
    """MAX of ``t`` over the processes of the default group, in one ``all_reduce`` (``t`` itself without one).

    Example:
        >>> all_reduce_max(torch.tensor([1.0, 2.0]))  # single process
        tensor([1., 2.])
    """
    return all_reduce_packed([t], "max")[0]


class LossSentinel:
    """The per-step trip test (see the module docstring).

    Call :meth:`observe_loss` with every micro-batch's loss and :meth:`check` once per optimizer step.

    Args:
        mode: ``"loss"`` or ``"loss+grads"``.
        detector: The loss-spike test.
        reduce_max: How the packed per-step values are reduced over processes; ``None`` in a single process.

    Example:
        >>> sentinel = LossSentinel("loss", SpikeDetector(warmup=2))
        >>> for step, loss in enumerate([1.0, 1.1, float("nan")]):
        ...     sentinel.observe_loss(torch.tensor(loss))
        ...     trip = sentinel.check(step)
        >>> trip.kind, trip.step, trip.last_finite_step
        ('nonfinite_loss', 2, 1)
    """

    def __init__(
        self, mode: str = "loss", detector: SpikeDetector | None = None, reduce_max: ReduceMax | None = None
    ) -> None:
        if mode not in SENTINEL_MODES:
            raise ValueError(f"sentinel: expected one of {[*SENTINEL_MODES, None]}, got {mode!r}")
        self.mode = mode
        self.detector = detector if detector is not None else SpikeDetector()
        self.reduce_max = reduce_max
        self.last_finite_step: int | None = None
        """The last step whose loss (and gradients, when checked) was finite."""
        self.previous_trip: int | None = None
        """The step of the most recent trip."""
        self._loss: Tensor | None = None

    def observe_loss(self, loss: Tensor) -> None:
        """Add one micro-batch's loss (as back-propagated, with any AMP scale) to the step's total, on its device."""
        value = loss.detach().float()
        if value.ndim:
            value = value.sum()
        self._loss = value if self._loss is None else self._loss + value

    def discard(self) -> None:
        """Forget the losses observed since the last check (an interrupted step)."""
        self._loss = None

    def reset(self) -> None:
        """Start a new run: no baseline, no trip, nothing observed (a checkpoint may then restore its state)."""
        self.detector.clear()
        self.last_finite_step = self.previous_trip = None
        self._loss = None

    def check(self, step: int, grads: Sequence[Tensor] = (), scale: Tensor | None = None) -> Trip | None:
        """Decide whether optimizer step ``step`` trips, with one host read (and one MAX all-reduce).

        Args:
            step: The optimizer step about to be taken.
            grads: Gradients to check for NaN/Inf (``"loss+grads"``); empty to skip.
            scale: AMP loss scale the observed losses were multiplied by.

        Returns:
            The trip, or ``None``. Steps without any observed loss (``training_step`` returned ``None``) do not trip.
        """
        loss = self._loss
        self._loss = None
        if loss is None:
            return None
        if scale is not None:
            loss = loss / scale.to(loss.device, torch.float32)
        grads = [stored_values(g) for g in grads] if self.mode == "loss+grads" else []
        value, bad_grad = self._read(loss, grads)
        bad_loss = not math.isfinite(value)
        kind: TripKind | None = None
        if bad_loss:
            kind, value = "nonfinite_loss", math.nan
        elif bad_grad:
            kind = "nonfinite_grad"
        elif self.detector.observe(value):
            kind = "loss_spike"
        if kind is None:
            self.last_finite_step = step
            return None
        # A trip never enters the window, so its median is still the one the step was compared with.
        baseline = self.detector.median()
        trip = Trip(step=step, kind=kind, loss=value, baseline=baseline, last_finite_step=self.last_finite_step)
        self.previous_trip = step
        return trip

    def _read(self, loss: Tensor, grads: Sequence[Tensor]) -> tuple[float, bool]:
        """``(loss, whether a gradient holds a NaN/Inf)``, with one host read, in at most four tensor ops.

        The loss and the gradients' infinity norms (one fused ``_foreach_norm``: it never overflows, and NaN
        propagates through the max) are stacked and read together. Over processes, NaN and -Inf become +Inf before
        the MAX all-reduce (a maximum with NaN is not defined), so every process sees a non-finite loss or gradient
        as +Inf, and the largest finite loss otherwise.
        """
        parts = [loss.reshape(())]
        if grads:
            parts += [norm.to(loss.device) for norm in torch._foreach_norm(list(grads), math.inf)]
        packed = torch.stack(parts) if len(parts) > 1 else parts[0].reshape(1)
        if self.reduce_max is not None:
            packed = self.reduce_max(torch.nan_to_num(packed, nan=math.inf, posinf=math.inf, neginf=math.inf))
        values = packed.tolist()  # the one read
        return values[0], not all(math.isfinite(v) for v in values[1:])

    def state_dict(self) -> dict[str, Any]:
        """The baseline window, the last finite step and the last trip: plain Python values."""
        return {
            "losses": list(self.detector.losses),
            "last_finite_step": self.last_finite_step,
            "previous_trip": self.previous_trip,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.detector.clear()
        for value in state.get("losses", []):
            self.detector.record(float(value))
        self.last_finite_step = state.get("last_finite_step")
        self.previous_trip = state.get("previous_trip")


# ------------------------------------------------------------------------------------------------------- replay
RngState = tuple[Tensor, Tensor | None]


def capture_rng(device: torch.device) -> RngState:
    """The CPU generator's state and, on CUDA, the device generator's (host-side copies; no device sync)."""
    accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), accelerator


def restore_rng(state: RngState, device: torch.device) -> None:
    """Set the generators to a state from :func:`capture_rng`."""
    cpu, accelerator = state
    torch.set_rng_state(cpu)
    if accelerator is not None:
        torch.cuda.set_rng_state(accelerator, device)


@dataclass(frozen=True)
class MicroBatch:
    """A reference to one micro-batch of the current optimizer step, with the RNG state it started with."""

    batch: Any
    batch_idx: int
    rng: RngState


class _StateSnapshot:
    """Everything a forward pass in train mode can change besides the graph: buffers and torchmetrics states.

    BatchNorm updates its running statistics and ``num_batches_tracked``; a torchmetrics metric updated inside
    ``training_step`` accumulates the micro-batch again. Both are copied before a replay and written back after it.
    """

    def __init__(self, module: nn.Module) -> None:
        from torchmetrics import Metric

        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.metrics: list[tuple[Metric, dict[str, Any]]] = []
        for m in module.modules():
            if isinstance(m, Metric):
                state = {name: _clone(getattr(m, name)) for name in m._defaults}
                state.update(_update_count=m._update_count, _computed=m._computed)
                self.metrics.append((m, state))

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        for metric, state in self.metrics:
            for name, value in state.items():
                setattr(metric, name, value)


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
) -> int:
    """Re-run one optimizer step's micro-batches through ``hooks``, leaving no trace in the training state.

    For each micro-batch the RNG state it started with is restored, ``run`` computes its loss (as back-propagated in
    training), and ``torch.autograd.grad`` sends the gradient back through the hooked outputs to every trainable
    parameter of ``module`` without accumulating into ``.grad``. Afterwards the hooks are removed and the RNG streams
    (torch's CPU and CUDA generators, Python's and NumPy's), the buffers and the torchmetrics states of ``module``
    are as they were, also when ``run`` raises.

    Args:
        micro_batches: The step's micro-batches, in order.
        run: Computes one micro-batch's loss; ``None`` when the step function skipped it.
        module: The module whose parameters receive (discarded) gradients and whose state is restored.
        hooks: Attached for the replay, removed after it.
        device: Where the step runs (for the accelerator RNG).

    Returns:
        The number of micro-batches that produced a loss.

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
    params = [p for p in module.parameters() if p.requires_grad]
    outer = capture_rng(device)
    python_state = random.getstate()
    numpy_state = _numpy_state()
    snapshot = _StateSnapshot(module)
    produced = 0
    try:
        with torch.enable_grad():
            hooks.attach()
            for micro in micro_batches:
                restore_rng(micro.rng, device)
                loss = run(micro)
                if loss is None:
                    continue
                produced += 1
                if loss.requires_grad and params:
                    torch.autograd.grad(loss, params, allow_unused=True)
                del loss
    finally:
        hooks.remove()
        snapshot.restore()
        restore_rng(outer, device)
        random.setstate(python_state)
        _set_numpy_state(numpy_state)
    return produced


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return None
    return numpy.random.get_state()


def _set_numpy_state(state: Any) -> None:
    if state is not None:
        import numpy

        numpy.random.set_state(state)
