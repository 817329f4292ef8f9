"""Which optimizer step is observed, and what a trip of the sentinel calls for: pure Python, tested by hand.

A step is observed when it is sampled, or when the sentinel trips on it (replayed, or parameters only when it cannot
be). Its :class:`Window` stays open through accumulation, LBFGS closures and validation until it is *finished* once
the optimizer has stepped (pooled, logged, diagnosed) or *discarded* (a skipped batch, the end of training, an
exception, a failed replay: nothing of it is logged).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = ["StepMicroBatches", "StepState", "Trip", "TripAction", "TripKind", "TripPlan", "Window", "plan_trip"]

TripKind = Literal["nonfinite_loss", "nonfinite_grad", "loss_spike"]


@dataclass(frozen=True)
class Trip:
    """What the sentinel saw on the optimizer step it tripped on.

    Attributes:
        step: The optimizer step.
        kind: ``"nonfinite_loss"``, ``"nonfinite_grad"`` (only with ``"loss+grads"``) or ``"loss_spike"``.
        loss: The step's loss (the sum of its micro-batch losses as Lightning back-propagates them, i.e. their mean;
            the largest over processes); NaN when not finite.
        baseline: The centre the spike test compared the loss with (the lower median of the latest healthy losses,
            :meth:`SpikeDetector.median`); ``None`` if unknown.
        last_finite_step: The last earlier step whose loss (and, with ``"loss+grads"``, gradients) was finite.
        replayed: Whether the step's statistics come from hooks (a replay, or a step that was sampled anyway).
        reason: Why the step was not replayed (empty when it was).
        nan_entry: Set by the replay of a ``nonfinite_*`` trip when the first selected layer with a non-finite
            output had received a non-finite input (see :mod:`lightning_hookdiag._provenance`): that layer.
        nan_origin: With ``nan_entry``: the innermost module whose forward made the NaN/Inf
            (:data:`~lightning_hookdiag.rules.ROOT` for the LightningModule's own), or ``None`` when it was made
            outside every module's forward.
        bad_batch: On a ``nonfinite_*`` trip: the floating-point tensors of the step's batch that hold NaN/Inf, as
            ``(path, NaN/Inf elements, elements)`` (``("batch[0]", 512, 512)``); empty when the data is finite.
    """

    step: int
    kind: TripKind
    loss: float
    baseline: float | None = None
    last_finite_step: int | None = None
    replayed: bool = False
    reason: str = ""
    nan_entry: str | None = None
    nan_origin: str | None = None
    bad_batch: tuple[tuple[str, int, int], ...] = ()


TripAction = Literal["record", "observed", "trace", "replay", "parameters"]

PERSISTS = "the previous step tripped too (a failure that persists is reported at its first step)"
UNSEEN = "its micro-batches were not seen by the callback (training resumed inside the step?)"


@dataclass(frozen=True)
class TripPlan:
    """What to do about a trip.

    ``action``: ``"record"``: only record the trip (no window, no finding); ``"observed"``: the step is sampled, its
    hooks saw it; ``"trace"``: sampled, and its micro-batches run again through the NaN/Inf trace alone; ``"replay"``:
    replay the step through the hooks into a new window; ``"parameters"``: open a window of the parameters only and
    sample the next step.
    """

    action: TripAction
    trip: Trip  # as recorded (replayed, reason set); a replay or a trace adds where the NaN/Inf was made
    trace: bool = False  # a replay also traces the NaN/Inf to the module that made it
    read_batch: bool = False  # look for NaN/Inf in the step's batch (bad_batch)

    def failed(self, reason: str) -> TripPlan:
        """The plan once a replay failed for ``reason``: parameters only, the next step sampled, nothing traced."""
        return TripPlan("parameters", replace(self.trip, replayed=False, reason=reason), read_batch=self.read_batch)


def plan_trip(
    trip: Trip, *, sampled: bool, traces: bool, blocker: str | None, previous: int | None, held: bool
) -> TripPlan:
    """What ``trip`` calls for.

    ``sampled``: the step's window is open (its hooks saw it); ``traces``: its NaN/Inf is worth tracing to the module
    that made it; ``blocker``: why the training loop cannot replay the step (manual optimization, a sharding strategy,
    a failed replay); ``previous``: the step of the trip before; ``held``: the step's micro-batches were kept.
    """
    persists = previous == trip.step - 1
    reason = PERSISTS if persists else blocker or (None if held else UNSEEN)
    read = trip.kind != "loss_spike" and held
    if sampled:
        action: TripAction = "trace" if traces and reason is None else "observed"
        return TripPlan(action, replace(trip, replayed=True), read_batch=read)
    if reason is None:
        return TripPlan("replay", replace(trip, replayed=True), trace=traces, read_batch=read)
    if persists:
        return TripPlan("record", replace(trip, reason=reason))
    return TripPlan("parameters", replace(trip, reason=reason), read_batch=read)


@dataclass
class Window:
    """The observation of optimizer step ``step``, from its opening to its logging.

    ``layers=False``: a trip that could not be replayed, where only the parameters are measured. ``stepped`` holds the
    ``id`` of every optimizer already measured (LBFGS calls the optimizer step hook once per closure evaluation: the
    first call sees the weights from before the step); ``stale``, the squares of the gradients still held at the
    window's first backward (``stale_gradients``).
    """

    step: int
    layers: bool = True
    trip: Trip | None = None
    stepped: set[int] = field(default_factory=set)
    stale: Any = None
    stale_checked: bool = False

    def first_call(self, optimizer: object) -> bool:
        """Whether ``optimizer`` is stepped here for the first time in this window (and record that it was)."""
        if id(optimizer) in self.stepped:
            return False
        self.stepped.add(id(optimizer))
        return True


class StepMicroBatches:
    """References to the micro-batches of the current optimizer step (what a replay re-runs), in order."""

    def __init__(self) -> None:
        self.step: int | None = None  # the optimizer step of the kept micro-batches (None: none kept)
        self.batches: list[Any] = []

    def keep(self, step: int, micro_batch: Any) -> None:
        """Add one micro-batch of optimizer step ``step``; those of an earlier step are dropped first."""
        if self.step != step:
            self.release()
            self.step = step
        self.batches.append(micro_batch)

    def holds(self, step: int) -> bool:
        """Whether the micro-batches of optimizer step ``step`` were seen (not, when training resumed inside it)."""
        return self.step == step and bool(self.batches)

    def release(self) -> None:
        """Drop every reference (the step is over, or the fit)."""
        self.batches = []
        self.step = None


class StepState:
    """The open step of one fit, the schedule of sampled steps, and the kept micro-batches.

    Args:
        every_n_steps: Steps ``0, n, 2n, ...`` are sampled.
    """

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps
        self.window: Window | None = None
        self.micro = StepMicroBatches()
        self.checked_step: int | None = None  # the sentinel's last (LBFGS: a step's first closure only)
        self.sample_next: int | None = None  # sampled out of schedule: the step after a trip that was not replayed
        # The sampled step the last batch found by sampled() was hooked for, when it fell inside the batch before it
        # (None: on time, or not sampled).
        self.late: int | None = None
        self._batch_step: int | None = None
        self._previous: int | None = None

    def sampled(self, step: int) -> bool:
        """Whether the training batch that starts at optimizer step ``step`` is hooked; call it at each batch start.

        A batch is hooked when a sampled step (``k % every_n_steps == 0``, or :attr:`sample_next`) is its first
        optimizer step, or lies between the first optimizer step of the batch before it and its own. The second
        case is manual optimization making several optimizer steps in one batch (a GAN): hooks see whole batches,
        so a sampled step inside a batch is observed on the next one (:attr:`late` names it). With one optimizer
        step per batch, consecutive batches start one step apart and only the first case occurs.
        """
        if step != self._batch_step:
            self._previous, self._batch_step = self._batch_step, step
        self.late = None
        if step % self.every_n_steps == 0 or step == self.sample_next:
            return True
        late = self._passed(step, self.every_n_steps)
        if late is None and self.sample_next is not None and self._previous is not None:
            late = self.sample_next if self._previous < self.sample_next < step else None
        self.late = late
        return late is not None

    def due(self, step: int, every: int) -> bool:
        """Whether a multiple of ``every`` is ``step`` or lies inside the batch before it (see :meth:`sampled`)."""
        return step % every == 0 or self._passed(step, every) is not None

    def _passed(self, step: int, every: int) -> int | None:
        """The last multiple of ``every`` after the previous batch's first step and before ``step``, or ``None``."""
        previous = self._previous
        if previous is None or previous >= step or previous // every == step // every:
            return None
        return step // every * every

    def open(self, step: int, layers: bool = True) -> Window:
        """Open the window of ``step`` (the callback closes a window before opening another)."""
        self.window = Window(step=step, layers=layers)
        return self.window

    def open_for(self, step: int) -> Window | None:
        """The open window if it is that of ``step``."""
        return self.window if self.window is not None and self.window.step == step else None

    def first_check(self, step: int) -> bool:
        """Whether the sentinel has yet to check ``step`` (and mark it checked)."""
        if self.checked_step == step:
            return False
        self.checked_step = step
        return True

    def close(self) -> Window | None:
        """Close the open window (to finish or discard it) and return it."""
        window, self.window = self.window, None
        return window
