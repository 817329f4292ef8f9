"""Outlier activations: kurtosis from pooled power sums, and the ratio of the absolute maximum to the spread.

:func:`power_sums` reduces a tensor to the sums ``act_kurtosis`` pools, :func:`finalize_kurtosis` turns pooled sums
into the kurtosis; ``act_absmax_over_std`` needs no state of its own (it is computed from ``act_absmax`` and
``act_std``). What the two statistics mean: ``docs/statistics.md#outlier-activations``.

Pooling: each tensor is reduced to power sums about a *shift* ``c``, ``[n, S1, S2, S3, S4]`` with ``S_k = sum((x -
c)^k)`` over its finite elements, which add up exactly over calls, micro-batches and processes as long as every one
of them uses the same ``c``. Raw power sums lose every digit to cancellation when the mean is large against the
spread, so, as for ``act_std``, each tensor's sums are formed from its *centred* sums ``M_k = sum((x - mean)^k)``
and its offset ``mean - c``, in float64: only the pooled recentring (``S4 / n - 4 mu S3 / n + ...`` with ``mu`` the
pooled mean about ``c``) cancels, losing about ``(|mean - c| / std)**4`` units of float64 rounding, under 1e-6
relative while ``|mean - c|`` stays below about ``100 std``. The callback takes ``c`` from the layer's pooled
``act_mean`` of the previous sampled step (the same value on every process), so only the first sampled step, with
``c = 0``, depends on ``|mean| / std`` (a tensor whose mean is 1000 times its spread: about 1e-3 there).

Example:
    >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0], dtype=torch.float64)
    >>> sums = power_sums(x)
    >>> sums.tolist()
    [5.0, 110.0, 10030.0, 1000100.0, 100000354.0]
    >>> round(finalize_kurtosis(sums[None]).item(), 4)
    3.2467
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hookdiag.aggregation import host_values
from lightning_hookdiag.components import Component, Setup, WindowStart, component
from lightning_hookdiag.stats import chunked_sum

__all__ = ["POWER_SLOTS", "Outliers", "finalize_kurtosis", "power_sums"]

POWER_SLOTS = 5
"""Length of a :func:`power_sums` vector: ``[count, S1, S2, S3, S4]``."""


def power_sums(x: Tensor, dtype: torch.dtype = torch.float64, shift: Tensor | float = 0.0) -> Tensor:
    """Power sums ``[n, sum d, sum d^2, sum d^3, sum d^4]`` of ``d = x - shift`` over the finite elements of ``x``.

    Formed from the centred sums of ``x``. NaN and Inf are left out (``act_nonfinite`` counts them). No host
    synchronisation.

    Args:
        x: Any floating-point tensor.
        dtype: Dtype of the computation and of the returned additive vector (float64 except on MPS).
        shift: The point the sums are taken about; sums add up only between tensors with the same shift. Close to
            the mean, the kurtosis pooled from them keeps every digit.

    Example:
        >>> x = torch.tensor([1e4 + 1.0, 1e4 - 1.0, 1e4 + 2.0, 1e4 - 2.0], dtype=torch.float64)
        >>> power_sums(x, shift=1e4).tolist()
        [4.0, 0.0, 10.0, 0.0, 34.0]
    """
    if not x.numel():
        return torch.zeros(POWER_SLOTS, dtype=dtype, device=x.device)
    return chunked_sum(lambda piece: _power_sums(piece, dtype, shift), x.detach())


def _power_sums(x: Tensor, dtype: torch.dtype, shift: Tensor | float) -> Tensor:
    # One piece of at most CHUNK_ELEMENTS. Centred sums in the accumulation dtype: float32 sums of cubes would carry a
    # rounding error that the recentring below multiplies by |mean| / std. Opt-in, so the extra width is paid only
    # when asked for; the work happens in place in one widened copy of the piece plus its square.
    work = x.detach().reshape(-1).to(dtype, copy=True)
    finite = torch.isfinite(work)
    n = torch.count_nonzero(finite)
    work.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    mean = work.sum() / n.clamp_min(1)
    centred = work.sub_(mean).mul_(finite)  # non-finite positions back to exactly 0: they add to no centred sum
    square = centred * centred
    m1 = centred.sum()
    m2 = square.sum()
    m3 = torch.dot(square, centred)
    m4 = torch.dot(square, square)
    # From sums about the tensor's mean to sums about the shift (m1 is the rounding of the mean).
    mu = mean - shift
    count = n.to(dtype)
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
    n = sums[:, 0]
    mean = sums[:, 1] / n
    e2, e3, e4 = sums[:, 2] / n, sums[:, 3] / n, sums[:, 4] / n
    m2 = e2 - mean**2
    m4 = e4 - 4 * mean * e3 + 6 * mean**2 * e2 - 3 * mean**4
    kurtosis = m4 / m2**2
    return torch.where(m2 > 0, kurtosis, torch.nan)


class Outliers(Component):
    """``act_kurtosis`` and ``act_absmax_over_std``.

    The power sums of every observed output are pooled in the sum state ``act_power``; the ratio needs no state.
    """

    def __init__(self, aggregator: Any, kurtosis: bool, absmax_over_std: bool) -> None:
        self._aggregator = aggregator
        self._kurtosis = kurtosis
        self._absmax_over_std = absmax_over_std
        agg, device = aggregator, aggregator.act_moments.device
        self._shift = torch.zeros(agg.n_layers, dtype=agg.acc_dtype, device=device)
        if kurtosis:
            agg.add_state(
                "act_power", torch.zeros(agg.n_layers, POWER_SLOTS, dtype=agg.acc_dtype, device=device), "sum"
            )
            self.on_output = self._power_sums

    @override
    def reset(self, window: WindowStart) -> None:
        if self._kurtosis:
            # Sums about the last pooled mean keep their digits when the mean dwarfs the spread; the logged mean is
            # the same on every process, so the sums still add up exactly.
            shift = [m if math.isfinite(m) else 0.0 for m in window.previous("act_mean")]
            self._shift = host_values(shift, self._shift.dtype, window.device)

    def _power_sums(self, layer: int, tensor: Tensor) -> None:
        agg = self._aggregator
        agg.pool("act_power", power_sums(tensor, agg.acc_dtype, self._shift[layer]), layer)

    @override
    def finalize(self, pooled: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out = {"act_kurtosis": finalize_kurtosis(pooled["act_power"])} if self._kurtosis else {}
        if self._absmax_over_std:
            out["act_absmax_over_std"] = pooled["act_absmax"] / pooled["act_std"]
        return out


@component
def _outliers(setup: Setup) -> Outliers | None:
    kurtosis, ratio = ("act_kurtosis" in setup.config.stats), ("act_absmax_over_std" in setup.config.stats)
    return Outliers(setup.aggregator, kurtosis, ratio) if kurtosis or ratio else None
