"""A statistic compared with its own history: the recent sampled steps' values, and what they project.

Pure Python: the trend rules (``docs/rules.md#trend-rules``) read a :class:`History`, and its
:meth:`History.state_dict` (plain lists) goes into the callback's checkpoint state.

Example:
    >>> history = History(window=4)
    >>> for step, value in enumerate([1.0, 2.0, 4.0, 8.0]):
    ...     history.push(step, {"attn_logit_max": {"blocks.0.attn": value}})
    >>> history.points("attn_logit_max", "blocks.0.attn")
    [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0)]
    >>> round(log_slope(history.points("attn_logit_max", "blocks.0.attn")), 6)  # ln 2 per step
    0.693147
    >>> crossing_step(history.points("attn_logit_max", "blocks.0.attn"), 50.0)  # 8 * 2**2.64
    6
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["History", "crossing_step", "log_slope", "rising_share"]

Point = tuple[int, float]


class History:
    """The last ``window`` (an integer ``>= 2``) finite values of every statistic in :attr:`stats` and name, by step."""

    stats = ("attn_logit_max", "logit_lse_mean", "logit_absmax", "step_loss", "param_update_ratio", "param_norm")
    """The statistics kept: the ones the trend rules read."""

    def __init__(self, window: int = 16) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"History: window expected an integer >= 2, got {window!r}")
        self.window = window
        self._points: dict[str, dict[str, list[Point]]] = {}

    def push(self, step: int, values: Mapping[str, Mapping[str, float]]) -> None:
        """Append one step's finite values; a step at or before the last one kept for a name replaces nothing."""
        for stat in self.stats:
            if not (group := values.get(stat)):
                continue
            kept = self._points.setdefault(stat, {})
            for name, value in group.items():
                if not (isinstance(value, (int, float)) and math.isfinite(value)):
                    continue
                points = kept.setdefault(name, [])
                if points and points[-1][0] >= step:
                    continue  # a replayed or repeated step: its values are already in
                points.append((int(step), float(value)))
                del points[: -self.window]

    def points(self, stat: str, name: str) -> list[Point]:
        """``(step, value)`` pairs, oldest first (empty without history)."""
        return list(self._points.get(stat, {}).get(name, ()))

    def state_dict(self) -> dict[str, Any]:
        """The kept values as JSON types: ``{"window": n, "points": {stat: {name: [[step, value], ...]}}}``."""
        points = {s: {n: [list(p) for p in ps] for n, ps in g.items()} for s, g in self._points.items()}
        return {"window": self.window, "points": points}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the last ``window`` values of a :meth:`state_dict` (missing keys: empty; malformed: ValueError)."""
        raw, where = state.get("points", {}), "History.load_state_dict"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: 'points' expects {{stat: {{name: [[step, value]]}}}}, got {raw!r}")
        out: dict[str, dict[str, list[Point]]] = {}
        for stat, group in raw.items():
            if not isinstance(group, Mapping):
                raise ValueError(f"{where}: {stat!r} expects {{name: [[step, value]]}}, got {group!r}")
            for name, points in group.items():
                try:
                    parsed = [(int(s), float(v)) for s, v in points]
                except (TypeError, ValueError):
                    raise ValueError(f"{where}: {stat}/{name} expects [[step, value], ...], got {points!r}") from None
                out.setdefault(stat, {})[name] = parsed[-self.window :]
        self._points = out


def log_slope(points: Sequence[Point]) -> float:
    """Least-squares slope of ``ln(value)`` against step: the growth rate per optimizer step (NaN where undefined)."""
    if len(points) < 2 or any(v <= 0 for _, v in points):
        return math.nan
    xs = [float(s) for s, _ in points]
    ys = [math.log(v) for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def rising_share(points: Sequence[Point]) -> float:
    """The share of consecutive pairs that rise (NaN with fewer than two points)."""
    if len(points) < 2:
        return math.nan
    return sum(1 for (_, a), (_, b) in zip(points, points[1:], strict=False) if b > a) / (len(points) - 1)


def crossing_step(points: Sequence[Point], threshold: float) -> int | None:
    """The optimizer step at which the fitted exponential trend of ``points`` reaches ``threshold``.

    The last value is projected forward at the rate of :func:`log_slope` (attention logits grow multiplicatively:
    ``W_q`` and ``W_k`` each scaled by ``1 + e`` scale every logit by ``(1 + e)**2``). ``None`` when the trend does not
    rise; the last step itself when the last value is already at or above ``threshold``.
    """
    if not points:
        return None
    last_step, last = points[-1]
    if last >= threshold:
        return last_step
    rate = log_slope(points)
    if not (rate > 0) or last <= 0:
        return None
    return last_step + math.ceil(math.log(threshold / last) / rate)
