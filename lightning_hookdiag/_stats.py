"""Pure tensor statistics: per-tensor sufficient statistics and their finalisation.

:func:`reduce_tensor`, the one pass a recorder makes over a tensor, reduces it to additive (counts, sums, sums of
squares) and maximum vectors; the finalisers turn the pooled vectors into the logged values. One path serves every
device: no host read, no branch on data, a fixed count of aten ops (``benchmarks/overhead.py --count-ops``).

Why this is exact without prescaling or centring: a float32 (or fp16/bf16) value and its square are exact in float64
(24 significant bits squared fit in 53), float32's largest square (1.2e77) and smallest (2e-90) are normal float64
numbers, and torch's sums are cascaded, so a sum of a million squares rounds at ~1e-15 relative whatever the CPU's
vector width. ``act_std`` is then ``sqrt(sumsq / n - mean**2)`` in float64: a mean ``10**4`` times the spread
costs 8 of float64's 16 digits, and leaves ~1e-9 (measured: 7.5e-10 on 1 M values of mean 1e4 and std 1; a float64
BLAS ``dot`` instead of ``mul`` + ``sum`` was 1.6e-6 off, so it serves only the gradients' sums of squares, which
do not cancel). Float64 inputs are exact to ~1e-16 per square, up to ``|x| ~ 1e154``. The contract:
``docs/statistics.md#the-numeric-contract``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_hookdiag._vocabulary import ALL_STATS, OPT_IN_STATS

__all__ = [
    "CHUNK_ELEMENTS",
    "LayerRows",
    "Workspace",
    "accumulation_dtype",
    "activation_row",
    "chunked_sum",
    "chunks",
    "finalize_activations",
    "finalize_dead_fraction",
    "finalize_gradients",
    "gradient_moments_from_rows",
    "gradient_row",
    "histogram_edges",
    "host_values",
    "moments_from_rows",
    "piece_sizes",
    "reduce_tensor",
    "resolve_names",
    "resolve_stats",
    "unit_maxima",
]

# Columns of the additive activation and activation-gradient vectors.
ACT_COUNT, ACT_NONZERO, ACT_NONZERO_FINITE, ACT_SUM, ACT_SUMSQ = range(5)
ACT_SLOTS = 5
GRAD_COUNT, GRAD_SUMSQ, GRAD_NONFINITE = range(3)
GRAD_SLOTS = 3
# Columns of the rows one output and one gradient are reduced to (:func:`activation_row`, :func:`gradient_row`).
ROW_NONZERO, ROW_NONZERO_FINITE, ROW_SUM, ROW_SUMSQ, ROW_MIN, ROW_MAX = range(6)
ACT_ROW = 6
GROW_NONZERO, GROW_NONZERO_FINITE, GROW_SUMSQ = range(3)
GRAD_ROW = 3

CHUNK_ELEMENTS = 1 << 18
"""The most elements one reduction reads at once (:func:`chunks`), which bounds every scratch buffer.

A piece costs a few kernel launches on an accelerator (a 64 M-element logits tensor: ~2,300, a few milliseconds per
sampled step); on a CPU the passes after the first read it from cache (a 2 M-element output reduced 1.7x faster in
pieces of 256 K than of 1 M).
"""


class LayerRows(NamedTuple):
    """One sampled step's statistics of every layer, as a recorder hands them to the pooled state.

    Finished per-layer tensors, summed over every call, micro-batch and replay of the step on this process; the
    pooled state adds them up (``act_moments``, ``grad_moments``, the histograms) or takes their maxima, then over
    processes.
    """

    act_moments: Tensor
    """``[n_layers, ACT_SLOTS]``: element count, non-zero, non-zero finite, sum, sum of squares (finite elements)."""
    act_absmax: Tensor
    """``[n_layers]`` float32: the largest finite ``|x|`` (0 where nothing ran)."""
    grad_moments: Tensor
    """``[n_layers, GRAD_SLOTS]``: element count, sum of squares (finite elements), non-finite count."""
    units: dict[int, Tensor]
    """Per-unit maxima (float32, :func:`unit_maxima`) of each unit layer that ran, by layer index."""
    unit_mismatch: frozenset[int]
    """Layers whose unit count changed on this process: their units are no longer recorded."""
    act_hist: Tensor | None = None
    """``[n_layers, bins]`` float32 counts of the outputs' finite values; ``None``: the step did not bin."""
    grad_hist: Tensor | None = None
    """The same, of the output gradients."""


def host_values(values: Iterable[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D tensor of host ``values`` on ``device``, without a stream synchronisation on CUDA.

    A copy from pageable memory makes the host wait for the device's queue; a pinned one sent with ``non_blocking``
    is queued like a kernel (torch keeps the pinned block alive until it is done).
    """
    host = torch.tensor(list(values), dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def chunks(x: Tensor, limit: int | None = None) -> Iterator[Tensor]:
    """Views of ``x`` of at most ``limit`` (default :data:`CHUNK_ELEMENTS`) elements that hold each element once.

    A contiguous tensor is cut along its flat view, any other along its leading dimensions: no piece is a copy.

    Example:
        >>> [tuple(p.shape) for p in chunks(torch.zeros(10), limit=4)]
        [(4,), (4,), (2,)]
        >>> [tuple(p.shape) for p in chunks(torch.zeros(4, 6).t(), limit=8)]  # not contiguous: leading rows
        [(2, 4), (2, 4), (2, 4)]
    """
    limit = CHUNK_ELEMENTS if limit is None else limit
    if x.numel() <= limit:
        yield x
    elif x.is_contiguous():
        yield from x.view(-1).split(limit)
    else:
        inner = x.numel() // x.shape[0]
        if inner <= limit:
            yield from x.split(limit // inner, dim=0)
        else:
            for row in x.unbind(0):
                yield from chunks(row, limit)


def chunked_sum(reduce: Callable[[Tensor], Tensor], x: Tensor, limit: int | None = None) -> Tensor:
    """``reduce(x)`` for an additive ``reduce``, taken piece by piece (:func:`chunks`): one ``add_`` per extra piece.

    Example:
        >>> chunked_sum(lambda p: p.square().sum(), torch.arange(10.0), limit=3).item()
        285.0
    """
    pieces = chunks(x, limit)
    total = reduce(next(pieces))
    for piece in pieces:
        total.add_(reduce(piece))
    return total


def resolve_stats(stats: Sequence[str] | None) -> tuple[str, ...]:
    """Validate a ``stats=`` argument (``None``: :data:`ALL_STATS`) and return it in vocabulary order.

    Example:
        >>> resolve_stats(["act_kurtosis", "act_std", "act_mean"])
        ('act_mean', 'act_std', 'act_kurtosis')
    """
    if stats is None:
        return ALL_STATS
    stats = [stats] if isinstance(stats, str) else list(stats) if isinstance(stats, Iterable) else stats
    if not isinstance(stats, list) or not all(isinstance(s, str) for s in stats):
        raise ValueError(f"stats: expected None, a statistic name or a sequence of names, got {stats!r}")
    return resolve_names("stats", "statistic", stats, ALL_STATS + OPT_IN_STATS)


def resolve_names(argument: str, noun: str, names: Sequence[object], known: Sequence[str]) -> tuple[str, ...]:
    """``names`` in the order of ``known``; a ``ValueError`` that lists ``known`` for an unknown name or none."""
    unknown = sorted({n if isinstance(n, str) else repr(n) for n in names if n not in known})
    if unknown:
        raise ValueError(f"{argument}: unknown {noun}(s) {unknown}; expected names from {list(known)}")
    if not names:
        raise ValueError(f"{argument}: expected at least one {noun} from {list(known)}, got an empty list")
    return tuple(n for n in known if n in names)


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """Dtype for pooled sums: float64 where the device has it, so that variance pooled from sums stays exact."""
    return torch.float32 if device.type == "mps" else torch.float64


# The float dtypes the reductions read as they are; others (float8, ...) are widened to float32 first.
_READ_AS_IS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class Workspace:
    """Scratch memory of the per-tensor reductions, reused within a sampled step, per device and dtype.

    On the CPU fresh temporaries cost page faults on every call (an 8 MB activation took 8.3 ms with them, 3.1 ms
    with reused buffers); views are kept per size too, so that a deep stack of equal layers does not pay a few
    microseconds of view creation per tensor. The owner releases it at the end of every sampled step.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], Tensor] = {}
        self._views: dict[tuple[int, torch.dtype, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}

    def _buffer(self, role: str, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (role, device, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < n:
            buffer = self._buffers[key] = torch.empty(n, dtype=dtype, device=device)
            self._views = {}  # views of the replaced buffer would keep it alive
        return buffer[:n]

    def get(self, n: int, dtype: torch.dtype, wide: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(finite, pair)``: ``n`` of ``dtype`` and a ``[2, n]`` of ``wide``."""
        key = (n, dtype, wide, device)
        views = self._views.get(key)
        if views is None:
            finite = self._buffer("narrow", n, dtype, device)
            pair = self._buffer("pair", 2 * n, wide, device).view(2, n)
            views = self._views[key] = (finite, pair)
        return views

    def release(self) -> None:
        """Drop the buffers."""
        self._buffers, self._views = {}, {}


def _finite_copy(x: Tensor, wide: torch.dtype, workspace: Workspace, dim: int | None) -> tuple[Tensor, ...]:
    """``(finite, pair, nonzero, nonzero_finite)``: ``x`` with NaN/Inf set to 0 in its own dtype, and two counts.

    Each pass is exact in any precision, and reads ``x``'s own bytes (half of float64's for float32 input). The counts
    are of the elements that compare unequal to 0 (NaN and Inf do, ``-0.0`` does not) before and after NaN/Inf removal,
    so their difference is the non-finite count. Each is written as float32 flags into the pair's memory (written only
    after the counts are taken) and summed, exact as a piece holds far fewer than 2**24 elements: on the CPU 35 us a
    256 K-element piece, against 43 us for ``count_nonzero`` of the bit pattern (which also needed a pass to turn
    ``-0.0`` into ``0.0``) and 197 us along a ``[97, 4096]`` stack's rows, where it sums a bool temporary unvectorised.

    Args:
        x: One piece of at most :data:`CHUNK_ELEMENTS` elements.
        wide: The dtype of the pair (``[value, value**2]``) the caller sums in.
        workspace: The reused scratch buffers the copy and the pair are written into.
        dim: Keep ``x``'s shape (per-unit maxima read along it) and count along it; ``None``: flat views and totals.
    """
    if x.numel() > CHUNK_ELEMENTS:
        raise ValueError(
            f"expected at most CHUNK_ELEMENTS={CHUNK_ELEMENTS} elements, got {x.numel()}: reduce the pieces of"
            " chunks(x) one by one (bounded scratch memory)"
        )
    x = x.detach()
    if x.dtype not in _READ_AS_IS:
        x = x.float()  # float8 and other exotic floats: widen exactly
    finite, pair = workspace.get(x.numel(), x.dtype, wide, x.device)
    finite, pair = finite.view(x.shape), pair.view(2, *x.shape)
    flags = pair.view(-1).view(torch.float32)[: x.numel()].view(x.shape)
    nonzero = _count_nonzero(x, dim, flags)
    torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=finite)
    nonzero_finite = _count_nonzero(finite, dim, flags)
    if dim is None:
        finite, pair = finite.view(-1), pair.view(2, -1)
    return finite, pair, nonzero, nonzero_finite


def _count_nonzero(x: Tensor, dim: int | None, flags: Tensor) -> Tensor:
    # The elements of x unequal to 0, in all (dim None) or along dim, through the float32 scratch flags.
    torch.ne(x, 0, out=flags)
    return flags.sum() if dim is None else flags.sum(dim=dim)


def activation_row(x: Tensor, out: Tensor, workspace: Workspace | None = None, dim: int | None = None) -> Tensor:
    """Reduce one non-empty floating-point tensor into the ``[ACT_ROW]`` row ``out``, in 10 tensor ops (a stack: 11).

    The row holds ``[nonzero, nonzero_finite, sum, sum_of_squares, min, max]`` in ``out.dtype`` (NaN and Inf count
    as non-zero, ``-0.0`` as zero; the rest are of the finite elements, NaN/Inf read as 0); the element count is
    known on the host. ``x`` is a piece of :func:`chunks` (larger raises ``ValueError``); ``out``, a row of the
    caller's table, is returned. ``dim=1`` reduces a ``[k, n]`` stack row by row into ``[k, ACT_ROW]`` in the same ops.

    Example:
        >>> activation_row(torch.tensor([0.0, -0.0, -3.0, 4.0, float("nan")]), torch.empty(ACT_ROW)).tolist()
        [3.0, 2.0, 1.0, 25.0, -3.0, 4.0]
        >>> x = torch.tensor([[0.0, -3.0, 4.0], [1.0, float("nan"), 2.0]])
        >>> activation_row(x, torch.empty(2, ACT_ROW), dim=1).tolist()
        [[2.0, 2.0, 1.0, 25.0, -3.0, 4.0], [3.0, 2.0, 3.0, 5.0, 0.0, 2.0]]
    """
    finite, pair, nonzero, nonzero_finite = _finite_copy(x, out.dtype, workspace or Workspace(), dim)
    # While the copy is still in cache. Along a stack's rows aminmax is not vectorised on the CPU (841 us for a [97,
    # 4096] stack, against 37 us for amin and amax apart); a whole tensor's is one vectorised pass.
    low, high = torch.aminmax(finite) if dim is None else (finite.amin(dim), finite.amax(dim))
    values, squares = pair
    values.copy_(finite)
    torch.mul(values, values, out=squares)
    total, square_total = pair.sum(dim=-1)  # cascaded, unlike a BLAS dot (see the module docstring)
    return torch.stack([nonzero, nonzero_finite, total, square_total, low, high], dim=-1, out=out)


def gradient_row(g: Tensor, out: Tensor, workspace: Workspace | None = None, dim: int | None = None) -> Tensor:
    """Reduce one gradient into the ``[GRAD_ROW]`` row ``out``, in 8 tensor ops (a stack: 9); as :func:`activation_row`.

    The row holds ``[nonzero, nonzero_finite, sum_of_squares]``: their difference is the non-finite count (counted as
    :func:`activation_row` counts), the sum of squares is over finite elements.

    Example:
        >>> gradient_row(torch.tensor([3.0, 0.0, -4.0, float("inf")]), torch.empty(GRAD_ROW)).tolist()
        [3.0, 2.0, 25.0]
        >>> gradient_row(torch.tensor([[3.0, 4.0], [float("inf"), -0.0]]), torch.empty(2, GRAD_ROW), dim=1).tolist()
        [[2.0, 2.0, 25.0], [1.0, 0.0, 0.0]]
    """
    finite, pair, nonzero, nonzero_finite = _finite_copy(g, out.dtype, workspace or Workspace(), dim)
    values, squares = pair
    values.copy_(finite)
    # A whole tensor's sum of squares is one BLAS dot (no cancellation: its rounding is far below what is logged); a
    # stack's is squares summed along its rows (dot has no batched form).
    square_total = torch.dot(values, values) if dim is None else torch.mul(values, values, out=squares).sum(dim=-1)
    return torch.stack([nonzero, nonzero_finite, square_total], dim=-1, out=out)


def piece_sizes(x: Tensor) -> list[int]:
    """The element counts of :func:`chunks`' pieces of ``x``: the counts of the rows :func:`reduce_tensor` writes.

    Example:
        >>> piece_sizes(torch.zeros(10)), piece_sizes(torch.zeros(CHUNK_ELEMENTS + 1))
        ([10], [262144, 1])
    """
    if x.numel() <= CHUNK_ELEMENTS:
        return [x.numel()]  # the common case: no views made to count
    return [piece.numel() for piece in chunks(x)]


def reduce_tensor(
    x: Tensor,
    out: Tensor | None,
    workspace: Workspace,
    grad: bool = False,
    units: bool = False,
    unit_dim: int | None = None,
    edges: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Every per-tensor reduction of one output (or gradient), in one pass over its pieces (:func:`chunks`).

    The one entry point from a tensor to its statistics: the recorder calls it and keeps what it writes and returns.
    Row ``i`` of ``out`` receives piece ``i``'s :func:`activation_row` (``grad``: :func:`gradient_row`); the caller
    sizes ``out`` with :func:`piece_sizes`. Returns ``(unit maxima, histogram counts)``: :func:`unit_maxima` with
    ``units``, counts of the finite elements in the ``len(edges) + 1`` bins with ``edges``; ``None`` where not asked.

    Args:
        x: The output or output gradient, any size (reduced piece by piece).
        out: ``[len(piece_sizes(x)), ACT_ROW or GRAD_ROW]`` rows to write; ``None``: no rows (only units or counts).
        workspace: The reused scratch buffers.
        grad: ``x`` is a gradient (:func:`gradient_row`), else an output (:func:`activation_row`).
        units: Also return the per-unit maxima along ``unit_dim``.
        unit_dim: The axis of the units (``None``: the default for ``x``'s rank).
        edges: The histogram's inner bin edges; ``None``: no histogram.

    Example:
        >>> table = torch.empty(1, ACT_ROW, dtype=torch.float64)
        >>> units, hist = reduce_tensor(torch.tensor([[1.0, -2.0]]), table, Workspace(), units=True)
        >>> table.tolist(), units.tolist(), hist
        ([[2.0, 2.0, -1.0, 5.0, -2.0, 1.0]], [1.0, -2.0], None)
    """
    reduce_row = gradient_row if grad else activation_row
    counts = None
    if edges is not None:  # .to: a no-op for the recorder's edges, which live on the statistics' device
        edges, counts = edges.to(x.device), torch.zeros(edges.numel() + 1, dtype=torch.float32, device=x.device)
    if out is not None or counts is not None:
        for i, piece in enumerate(chunks(x)):
            if out is not None:
                reduce_row(piece, out[i], workspace)
            # counts exists exactly when edges does; testing both narrows both for the type checker.
            if counts is not None and edges is not None:
                _bin(piece, edges, counts)
    return unit_maxima(x, unit_dim) if units else None, counts


def _bin(piece: Tensor, edges: Tensor, counts: Tensor) -> None:
    # Bin i counts the finite edges[i-1] < x <= edges[i]; with scatter_add, as bincount's output size depends on the
    # data, which forces a host synchronisation.
    flat = piece.detach()
    flat = (flat if flat.dtype in (torch.float32, torch.float64) else flat.float()).reshape(-1)
    finite = torch.isfinite(flat)
    index = torch.bucketize(torch.where(finite, flat, 0.0), edges)
    counts.scatter_add_(0, index, finite.to(torch.float32))


def moments_from_rows(rows: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Additive ``[k, ACT_SLOTS]`` moments and ``[k]`` absolute maxima of :func:`activation_row` rows and counts."""
    moments = torch.cat([counts[:, None], rows[:, :ROW_MIN]], dim=1)
    return moments, torch.maximum(rows[:, ROW_MAX], rows[:, ROW_MIN].neg())


def gradient_moments_from_rows(rows: Tensor, counts: Tensor) -> Tensor:
    """Additive ``[k, GRAD_SLOTS]`` moments ``[count, sum_sq, nonfinite]`` of ``[k, GRAD_ROW]`` rows and counts."""
    nonfinite = rows[:, GROW_NONZERO] - rows[:, GROW_NONZERO_FINITE]
    return torch.stack([counts, rows[:, GROW_SUMSQ], nonfinite], dim=1)


def unit_maxima(x: Tensor, unit_dim: int | None = None) -> Tensor:
    """Per-unit maximum over every other axis, in ``x``'s dtype, in two tensor ops.

    Units lie along ``unit_dim``, by default channels (dim 1) of 4-D/5-D outputs, the last dim of 1-D/2-D/3-D ones.
    A unit is dead when its maximum is ``<= 0``: it was non-positive for every sample and position. Pooled with
    ``fmax``, these maxima reduce over the batch *first*, as they must. A NaN is not ``<= 0``, so NaN maxima become
    ``+inf``: they would otherwise vanish in ``fmax`` pooling and leave the unit looking dead.

    Example:
        >>> unit_maxima(torch.tensor([[0.0, 2.0, -1.0], [0.0, -1.0, float("nan")]])).tolist()
        [0.0, 2.0, inf]
    """
    x = x.detach() if x.ndim else x.detach().reshape(1)
    dim = unit_dim % x.ndim if unit_dim is not None else 1 if x.ndim >= 4 else x.ndim - 1
    others = [d for d in range(x.ndim) if d != dim]
    maxima = x.amax(dim=others) if others else x
    return torch.nan_to_num(maxima, nan=math.inf, posinf=math.inf, neginf=-math.inf)


def finalize_activations(moments: Tensor, absmax: Tensor) -> dict[str, Tensor]:
    """Turn pooled ``[n_layers, 5]`` moments and ``[n_layers]`` absmax into per-layer statistic vectors.

    Example:
        >>> moments = torch.tensor([[4.0, 3.0, 2.0, -2.0, 10.0]])  # of [0.0, 1.0, -3.0, nan]
        >>> {k: round(v.item(), 4) for k, v in finalize_activations(moments, torch.tensor([3.0])).items()}
        {'act_mean': -0.6667, 'act_std': 1.6997, 'act_absmax': 3.0, 'act_zero_frac': 0.25, 'act_nonfinite': 1.0}
    """
    count, nonzero = moments[:, ACT_COUNT], moments[:, ACT_NONZERO]
    nonfinite = nonzero - moments[:, ACT_NONZERO_FINITE]
    finite = count - nonfinite
    mean = moments[:, ACT_SUM] / finite
    var = (moments[:, ACT_SUMSQ] / finite - mean.square()).clamp_min(0)
    return {
        "act_mean": mean,
        "act_std": var.sqrt(),
        "act_absmax": absmax.to(moments.dtype),
        "act_zero_frac": (count - nonzero) / count,
        "act_nonfinite": nonfinite,
    }


def finalize_gradients(moments: Tensor, scale: Tensor | None = None) -> dict[str, Tensor]:
    """Pooled ``[n_layers, 3]`` moments to ``act_grad_norm`` (AMP loss ``scale`` divided out), ``act_grad_nonfinite``.

    Example:
        >>> moments = torch.tensor([[2.0, 100.0, 0.0]])  # of [6.0, 8.0]
        >>> finalize_gradients(moments, scale=torch.tensor(2.0))["act_grad_norm"].tolist()
        [5.0]
    """
    norm = moments[:, GRAD_SUMSQ].sqrt()
    if scale is not None:
        norm = norm / scale.to(norm.dtype)
    return {"act_grad_norm": norm, "act_grad_nonfinite": moments[:, GRAD_NONFINITE]}


def finalize_dead_fraction(unit_max: Tensor, owner: Tensor, n_layers: int, dtype: torch.dtype) -> Tensor:
    """Per-layer fraction of units whose pooled maximum is ``<= 0``; NaN for layers with no tracked units.

    ``unit_max`` holds the flat per-unit maxima of every tracked layer, ``owner`` the layer of each entry.

    Example:
        >>> finalize_dead_fraction(torch.tensor([0.0, 2.0, -1.0, 3.0]), torch.tensor([0, 0, 2, 2]), 3, torch.float32)
        tensor([0.5000,    nan, 0.5000])
    """
    counts = torch.zeros(n_layers, dtype=dtype, device=unit_max.device)
    dead = torch.zeros_like(counts).index_add_(0, owner, (~(unit_max > 0)).to(dtype))
    counts.index_add_(0, owner, torch.ones_like(unit_max, dtype=dtype))
    return dead / counts


def histogram_edges(bins: int, smallest: float = 1e-6, largest: float = 1e4) -> Tensor:
    """Fixed, symmetric log-spaced bin boundaries: ``bins - 1`` edges covering ``±[smallest, largest]`` and 0.

    The edges do not depend on the data, so histograms of micro-batches and processes add up exactly. Values beyond
    ``largest`` land in the two outer bins.

    Example:
        >>> histogram_edges(6, smallest=0.1, largest=10.0).tolist()
        [-10.0, -0.10000000149011612, 0.0, 0.10000000149011612, 10.0]
    """
    if bins < 4 or bins % 2:
        raise ValueError(f"histogram bins: expected an even number >= 4, got {bins}")
    magnitudes = torch.logspace(math.log10(smallest), math.log10(largest), bins // 2 - 1)
    return torch.cat([-magnitudes.flip(0), torch.zeros(1), magnitudes])
