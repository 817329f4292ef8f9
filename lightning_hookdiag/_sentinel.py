"""The always-on sentinel (``docs/sentinel.md``): a cheap per-step trip test (the replay of a tripped step: ``_rerun``).

Nothing here knows Lightning, the rules or logging.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_hookdiag._params import stored_values
from lightning_hookdiag._stats import accumulation_dtype
from lightning_hookdiag._step_state import Trip, TripKind
from lightning_hookdiag._validation import choice

__all__ = ["SENTINEL_MODES", "LossSentinel", "NoSentinel", "Sentinel", "SpikeDetector"]

SENTINEL_MODES: tuple[str, ...] = ("loss", "loss+grads")
"""Values of the callback's ``sentinel`` argument besides ``None``."""


@dataclass(eq=False)
class SpikeDetector:
    """Robust loss-spike test (``docs/sentinel.md``): a rise far above the recent healthy losses, in noise units.

    Both a factor and a spread, because the spread alone would trip on an almost constant loss, the ratio alone on a
    noisy one. ``scale``: the median non-zero ``|loss|``. Host cost: 1.5 us when the loss is below ``ratio`` times the
    smallest recent loss, else 12 us.

    Args:
        window: Number of recent healthy losses kept.
        warmup: Healthy losses needed before anything can trip.
        zscore: Minimum rise in robust standard deviations of the step-to-step noise.
        ratio: Minimum rise as a factor of the centre (log scale) or of ``max(|centre|, scale)`` (linear scale).
        recent: How many of the latest healthy (positive, on the log scale) losses the centre is the median of.
        floor: On the log scale, the smallest spike as a share of :attr:`start`; 0: no floor.
        early: How many of the run's first positive healthy losses :attr:`start` is the lower median of.

    Example:
        >>> detector = SpikeDetector(window=50, warmup=5, zscore=8.0, ratio=10.0)
        >>> [detector.observe(loss) for loss in (1.0, 0.9, 1.1, 0.95, 1.05)]
        [False, False, False, False, False]
        >>> detector.median()
        1.0
        >>> detector.observe(2.0), detector.observe(1e8)  # noise is recorded; the spike is not
        (False, True)
        >>> descent = SpikeDetector(warmup=5)
        >>> for loss in (2.0, 1.9, 2.1, 1.8, 2.0, 2e-5, 2.04e-5, 1.96e-5, 2e-5, 2.04e-5, 1.96e-5):
        ...     _ = descent.observe(loss)
        >>> descent.start, descent.is_spike(8e-4), descent.is_spike(27.7)  # 8e-4 is 4e-4 of the start: no spike
        (2.0, False, True)
    """

    window: int = 50
    warmup: int = 20
    zscore: float = 8.0
    ratio: float = 10.0
    recent: int = 5
    floor: float = 1e-2
    early: int = 3

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Empty the window and forget the run's early level."""
        self.start: float | None = None
        """The run's scale where it started: the lower median of its first ``early`` positive healthy losses.

        Its first few steps, not its warmup: a classifier can fall from 1.6 to 1e-5 within 20 steps, and the median of
        those 20 losses is already inside the collapse. Three steps: one odd batch among them does not set it.
        """
        self._early: list[float] = []
        self.losses: deque[float] = deque(maxlen=self.window)
        # Logs of the window's positive losses, oldest first, taken once when a loss enters the window (the test
        # runs on every optimizer step).
        self._logs: deque[float] = deque()
        self._negative = 0
        self._log_ratio = math.log(self.ratio)

    def median(self) -> float | None:
        """The centre the next loss is compared with (on the log scale, of positive losses only); ``None``: none."""
        linear = self._negative > 0
        latest = [v for v in reversed(self.losses) if linear or v > 0][: self.recent]
        return statistics.median_low(latest) if latest else None

    def is_spike(self, loss: float) -> bool:
        """Whether ``loss`` (finite) is a spike against the window, without recording it."""
        if len(self.losses) < max(self.warmup, 1):
            return False
        linear = self._negative > 0 or loss < 0
        # Fewer than 3 positive losses: a non-negative window's log scale cannot be trusted yet.
        if not linear and (loss <= 0 or len(self._logs) < 3):
            return False
        values = self.losses if linear else self._logs
        latest = list(itertools.islice(reversed(values), self.recent))
        if linear:
            nonzero = [abs(v) for v in values if v != 0]
            scale = statistics.median(nonzero) if nonzero else 0.0
            value, least = loss, (self.ratio - 1) * max(abs(statistics.median_low(latest)), scale)
        else:
            value, least = math.log(loss), self._log_ratio
            # The centre is at least the smallest of the latest logs: below log(ratio) above it, no spike. The common
            # case, decided without a sort.
            level = self._level()
            if value - min(latest) <= least or (level is not None and loss < self.floor * level):
                return False
        # The lower median is one of the values (the mean of the middle two is not): the centre of the logs is the log
        # of the centre.
        rise = value - statistics.median_low(latest)
        return rise > least and rise > self.zscore * _step_spread(list(values))

    def record(self, loss: float) -> None:
        """Add a healthy loss to the window."""
        if len(self.losses) == self.window:  # the oldest loss is about to leave the window
            oldest = self.losses[0]
            if oldest > 0:
                self._logs.popleft()
            self._negative -= oldest < 0
        self.losses.append(loss)
        if loss > 0:
            self._logs.append(math.log(loss))
            if self.start is None:
                self._early.append(loss)
                if len(self._early) >= max(self.early, 1):
                    self.start, self._early = statistics.median_low(self._early), []
        self._negative += loss < 0

    def _level(self) -> float | None:
        """:attr:`start`, or while fewer than ``early`` positive losses were seen (a warmup below it), theirs."""
        if self.start is not None:
            return self.start
        return statistics.median_low(self._early) if self._early else None

    def observe(self, loss: float, step: int | None = None) -> bool:
        """Test ``loss`` and record it as healthy if it did not trip; returns whether it tripped.

        ``step`` is the optimizer step the loss ends (``None`` outside a fit): this test does not need it; a subclass
        passed as ``SentinelConfig(detector=...)`` may (a test that trips on chosen steps).
        """
        spike = self.is_spike(loss)
        if not spike:
            self.record(loss)
        return spike


def _step_spread(values: list[float]) -> float:
    """Robust standard deviation of the noise of ``values`` from their consecutive differences, free of any trend."""
    if len(values) < 2:
        return 0.0
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    trend = statistics.median(steps)
    # 1.4826 times the MAD of a normal distribution is its standard deviation.
    return 1.4826 * statistics.median([abs(s - trend) for s in steps]) / math.sqrt(2)


class LossSentinel:
    """The per-step trip test: a NaN/Inf loss (or, with ``"loss+grads"``, gradient), or a loss spike.

    Call :meth:`observe_loss` with every micro-batch's loss and :meth:`check` once per optimizer step. ``reduce_max``
    reduces the packed per-step values over processes (``None``: a single process).

    Attributes:
        keeps_batches: The step's micro-batches are kept for a replay (:class:`NoSentinel`: never trips, keeps none).

    Example:
        >>> sentinel = LossSentinel("loss", SpikeDetector(warmup=2))
        >>> for step, loss in enumerate([1.0, 1.1, float("nan")]):
        ...     sentinel.observe_loss(torch.tensor(loss))
        ...     trip = sentinel.check(step)
        >>> trip.kind, trip.step, trip.last_finite_step
        ('nonfinite_loss', 2, 1)
    """

    keeps_batches = True

    def __init__(
        self,
        mode: str = "loss",
        detector: SpikeDetector | None = None,
        reduce_max: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        # The callback's sentinel=None is a NoSentinel; a LossSentinel needs a mode.
        self.mode = choice("sentinel", mode, SENTINEL_MODES)
        self.detector = detector if detector is not None else SpikeDetector()
        self.reduce_max = reduce_max
        self.last_finite_step: int | None = None
        """The last step whose loss (and gradients, when checked) was finite."""
        self.previous_trip: int | None = None
        """The step of the most recent trip."""
        self._loss: Tensor | None = None

    def observe_loss(self, loss: Tensor) -> None:
        """Add one micro-batch's loss (as back-propagated, with any AMP scale) to the step's total, on its device.

        In float64 where the device has it: a finite ``1e300`` (``precision="64-true"``) stays finite.
        """
        value = loss.detach().to(accumulation_dtype(loss.device))
        if value.ndim:
            value = value.sum()
        self._loss = value if self._loss is None else self._loss + value

    def discard(self) -> None:
        """Forget the losses observed since the last check (an interrupted step)."""
        self._loss = None

    def check(self, step: int, grads: Sequence[Tensor] = (), scale: Tensor | None = None) -> Trip | None:
        """Decide whether the optimizer step about to be taken trips, with one host read (and one MAX all-reduce).

        ``grads`` are checked for NaN/Inf (``"loss+grads"``; empty: skipped); ``scale`` is the AMP loss scale the
        observed losses were multiplied by. A step without any observed loss (``training_step`` returned ``None``)
        does not trip.
        """
        loss, self._loss = self._loss, None
        if loss is None:
            return None
        if scale is not None:
            loss = loss / scale.to(loss.device, torch.float32)
        grads = [stored_values(g) for g in grads] if self.mode == "loss+grads" else []
        value, bad_grad = self._read(loss, grads)
        kind: TripKind | None = None
        if not math.isfinite(value):
            kind, value = "nonfinite_loss", math.nan
        elif bad_grad:
            kind = "nonfinite_grad"
        elif self.detector.observe(value, step):
            kind = "loss_spike"
        if kind is None:
            self.last_finite_step = step
            return None
        self.previous_trip = step
        # A trip never enters the window, so its median is still the one the step was compared with.
        baseline = self.detector.median()
        return Trip(step=step, kind=kind, loss=value, baseline=baseline, last_finite_step=self.last_finite_step)

    def _read(self, loss: Tensor, grads: Sequence[Tensor]) -> tuple[float, bool]:
        """``(loss, whether a gradient holds a NaN/Inf)``, with one host read, in at most four tensor ops.

        The gradients' infinity norms (one fused ``_foreach_norm``) never overflow and propagate NaN. Before the MAX
        all-reduce NaN and -Inf become +Inf (a maximum with NaN is not defined): every process sees the same trip.
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
        """The baseline window, the run's early loss level, the last finite step and the last trip: plain values."""
        return {
            "losses": list(self.detector.losses),
            "start": self.detector.start,
            "last_finite_step": self.last_finite_step,
            "previous_trip": self.previous_trip,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.detector.clear()
        for value in state.get("losses", []):
            self.detector.record(float(value))
        if state.get("start") is not None:  # older checkpoints: the level of the restored window's first losses
            self.detector.start = float(state["start"])
        self.last_finite_step = state.get("last_finite_step")
        self.previous_trip = state.get("previous_trip")


class NoSentinel:
    """The callback's ``sentinel=None``: the interface of :class:`LossSentinel`, checking nothing and holding nothing.

    Its checkpoint entry is ``None``, as every checkpoint of a run without a sentinel has it.

    Example:
        >>> sentinel = NoSentinel()
        >>> sentinel.observe_loss(torch.tensor(float("nan")))
        >>> sentinel.check(0) is None, sentinel.state_dict() is None, sentinel.keeps_batches
        (True, True, False)
    """

    keeps_batches = False
    mode = None
    last_finite_step = None
    previous_trip = None

    def __init__(self) -> None:
        self.reduce_max: Callable[[Tensor], Tensor] | None = None  # set by the callback as for a LossSentinel; unused

    def observe_loss(self, loss: Tensor) -> None:
        """Ignore the loss: nothing is checked."""

    def discard(self) -> None:
        """Nothing is held."""

    def check(self, step: int, grads: Sequence[Tensor] = (), scale: Tensor | None = None) -> Trip | None:
        """Never trips."""
        return None

    def state_dict(self) -> None:
        """``None``: the checkpoint entry of a run without a sentinel."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: a baseline from a run with a sentinel goes unused."""


Sentinel = LossSentinel | NoSentinel
"""What the callback checks each optimizer step with."""
