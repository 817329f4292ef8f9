"""Outlier activations (``docs/statistics.md#outlier-activations``): kurtosis from pooled power sums, absmax / std.

Each tensor is reduced to power sums about a *shift* ``c``, which add up exactly over calls, micro-batches and
processes that share ``c``. They are formed in float64 from the tensor's centred sums and its offset ``mean - c``,
so only the pooled recentring cancels, losing about ``(|mean - c| / std)**4`` units of float64 rounding (under 1e-6
relative below ``100 std``). ``c`` is the layer's pooled ``act_mean`` of the previous sampled step, so only the first
sampled step, with ``c = 0``, depends on ``|mean| / std`` (a mean 1000 times the spread: about 1e-3 there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hookdiag._aggregation import LayerStatsAggregator, host_values
from lightning_hookdiag._opt_in import layer_sums
from lightning_hookdiag._stats import chunked_sum
from lightning_hookdiag.components import Component, Setup, WindowStart, component

__all__ = ["POWER_SLOTS", "Outliers", "finalize_kurtosis", "outliers", "power_sums"]

POWER_SLOTS = 5
"""Length of a :func:`power_sums` vector: ``[count, S1, S2, S3, S4]``."""


def power_sums(x: Tensor, dtype: torch.dtype = torch.float64, shift: Tensor | float = 0.0) -> Tensor:
    """Power sums ``[n, sum d, sum d^2, sum d^3, sum d^4]`` of ``d = x - shift`` over the finite elements of ``x``.

    NaN and Inf are left out (``act_nonfinite`` counts them). No host synchronisation. Computed and returned in
    ``dtype`` (float64 except on MPS). The closer ``shift`` is to the mean, the more digits the kurtosis keeps.

    Example:
        >>> x = torch.tensor([1e4 + 1.0, 1e4 - 1.0, 1e4 + 2.0, 1e4 - 2.0], dtype=torch.float64)
        >>> power_sums(x, shift=1e4).tolist()
        [4.0, 0.0, 10.0, 0.0, 34.0]
    """
    return chunked_sum(lambda piece: _power_sums(piece, dtype, shift), x.detach())


def _power_sums(x: Tensor, dtype: torch.dtype, shift: Tensor | float) -> Tensor:
    # Centred sums in the accumulation dtype: float32 sums of cubes would carry a rounding error that the recentring
    # multiplies by |mean| / std. Opt-in, so the width is paid only when asked for, in place in one widened copy of
    # the piece plus its square.
    work = x.reshape(-1).to(dtype, copy=True)
    finite = torch.isfinite(work)
    n = torch.count_nonzero(finite)
    work.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    mean = work.sum() / n.clamp_min(1)
    centred = work.sub_(mean).mul_(finite)  # non-finite positions back to exactly 0: they add to no centred sum
    square = centred * centred
    m1, m2 = centred.sum(), square.sum()  # m1: the rounding of the mean
    m3, m4 = torch.dot(square, centred), torch.dot(square, square)
    mu, count = mean - shift, n.to(dtype)
    s1 = m1 + count * mu
    s2 = m2 + 2 * mu * m1 + count * mu**2
    s3 = m3 + 3 * mu * m2 + 3 * mu**2 * m1 + count * mu**3
    s4 = m4 + 4 * mu * m3 + 6 * mu**2 * m2 + 4 * mu**3 * m1 + count * mu**4
    return torch.stack([count, s1, s2, s3, s4])


def finalize_kurtosis(sums: Tensor) -> Tensor:
    """Pearson's kurtosis per layer from pooled ``[n_layers, 5]`` power sums; NaN where the spread is 0 or nothing ran.

    Example:
        >>> parts = [power_sums(torch.tensor(v)) for v in ([1.0, 2.0], [3.0, 4.0, 100.0])]
        >>> round(finalize_kurtosis(torch.stack(parts).sum(0, keepdim=True)).item(), 4)
        3.2467
    """
    mean, e2, e3, e4 = (sums[:, 1:] / sums[:, :1]).unbind(1)
    m2 = e2 - mean**2
    m4 = e4 - 4 * mean * e3 + 6 * mean**2 * e2 - 3 * mean**4
    return torch.where(m2 > 0, m4 / m2**2, torch.nan)


class Outliers(Component):
    """``act_kurtosis`` (output power sums, pooled in ``act_power``) and ``act_absmax_over_std`` (needs no state)."""

    def __init__(self, agg: LayerStatsAggregator, kurtosis: bool, absmax_over_std: bool) -> None:
        self._kurtosis, self._absmax_over_std = kurtosis, absmax_over_std
        self._shift = agg.new_state(agg.n_layers)
        if kurtosis:
            # About the last pooled mean, the same on every process: the sums keep their digits and still add up.
            self.on_output = layer_sums(
                agg, "act_power", POWER_SLOTS, lambda layer, t: power_sums(t, agg.acc_dtype, self._shift[layer])
            )

    @override
    def reset(self, window: WindowStart) -> None:
        if self._kurtosis:
            shift = [m if math.isfinite(m) else 0.0 for m in window.previous("act_mean")]
            self._shift = host_values(shift, self._shift.dtype, window.device)

    @override
    def finalize(self, pooled: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out = {"act_kurtosis": finalize_kurtosis(pooled["act_power"])} if self._kurtosis else {}
        if self._absmax_over_std:
            out["act_absmax_over_std"] = pooled["act_absmax"] / pooled["act_std"]
        return out


@component
def outliers(setup: Setup) -> Outliers | None:
    """The fit's :class:`Outliers`, when ``act_kurtosis`` or ``act_absmax_over_std`` is in ``stats=``."""
    kurtosis, ratio = ("act_kurtosis" in setup.config.stats), ("act_absmax_over_std" in setup.config.stats)
    return Outliers(setup.aggregator, kurtosis, ratio) if kurtosis or ratio else None
