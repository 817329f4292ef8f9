"""Exact pooling of per-layer statistics over calls, micro-batches and processes, in torchmetrics state.

torchmetrics keeps the states (reset, device moves, ``compute``); its gather-based sync is replaced by one SUM and one
MAX ``all_reduce`` of packed buffers (``docs/integrations.md#what-is-synced-and-how``). Hook calls write rows into a
call table, folded into the states in a constant number of ops per step. A layer's unit count (``act_dead_frac``) is
agreed through the SUM buffer of the first sync in which any process saw it, so every process has the same layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_hookdiag.distributed import all_reduce_packed
from lightning_hookdiag.params import P_SEEN, P_SLOTS, P_WEIGHT_SQ, finalize_parameters
from lightning_hookdiag.stats import (
    ACT_COUNT,
    ACT_ROW,
    ACT_SLOTS,
    GRAD_COUNT,
    GRAD_ROW,
    GRAD_SLOTS,
    finalize_activations,
    finalize_dead_fraction,
    finalize_gradients,
    gradient_moments_from_rows,
    histogram_edges,
    moments_from_rows,
)

__all__ = ["LayerOrders", "LayerStatsAggregator", "agreed_orders", "host_values", "order_positions"]

ORDER_SLOTS = 5  # per layer: forward latest, -forward earliest, backward latest, -backward earliest, missing gradient


class LayerOrders(NamedTuple):
    """Layer indices in forward order, in backward order, and those whose output received no gradient."""

    forward: list[int]
    backward: list[int]
    missing_grads: list[int]


def order_positions(orders: LayerOrders, n_layers: int) -> list[float]:
    """One process's ``orders`` as ``n_layers`` rows of :data:`ORDER_SLOTS` values, merged by their maxima.

    A layer's row holds its first-call position in the forward and in the backward order and minus it (their maxima:
    the latest and the earliest position over the processes where it ran; ``-1`` and ``-inf`` where it did not), and
    1 if its output received no gradient here.
    """
    rows = [[-1.0, -math.inf, -1.0, -math.inf, 0.0] for _ in range(n_layers)]
    for column, order in ((0, orders.forward), (2, orders.backward)):
        for position, layer in enumerate(order):
            rows[layer][column], rows[layer][column + 1] = float(position), -float(position)
    for layer in orders.missing_grads:
        rows[layer][4] = 1.0
    return [value for row in rows for value in row]


def agreed_orders(maxima: Sequence[float], n_layers: int) -> LayerOrders:
    """The orders every process agrees on, from the maxima over processes of :func:`order_positions`.

    Layers that ran somewhere sort by their latest first-call position over the processes, then the earliest, then
    their index: where every process runs the same layers this is their own order, and a layer run by some processes
    only sits where they ran it when the others run what precedes it at the same places (a heuristic beyond that: no
    reduction of a few numbers per layer can merge arbitrary orders). A layer misses its gradient if it did anywhere.

    Example:
        >>> rank0 = order_positions(LayerOrders([0, 1, 3], [], []), 4)  # layer 2 runs on rank 1 only
        >>> rank1 = order_positions(LayerOrders([0, 1, 2, 3], [], []), 4)
        >>> agreed_orders([max(a, b) for a, b in zip(rank0, rank1)], 4).forward
        [0, 1, 2, 3]
    """
    rows = [maxima[i * ORDER_SLOTS : (i + 1) * ORDER_SLOTS] for i in range(n_layers)]

    def merged(column: int) -> list[int]:
        ran = [i for i in range(n_layers) if rows[i][column] >= 0]
        return sorted(ran, key=lambda i: (rows[i][column], -rows[i][column + 1], i))

    return LayerOrders(merged(0), merged(2), [i for i in range(n_layers) if rows[i][4] > 0])


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


class LayerStatsAggregator(Metric):
    """Pooled sufficient statistics of ``n_layers`` modules for one sampled optimizer step.

    Args:
        n_layers: Number of observed modules; observations refer to them by index.
        n_params: Number of observed parameters (:mod:`lightning_hookdiag.params`).
        dtype: Dtype of the additive states (float64 keeps variance pooled from sums exact).
        sharded_params: Each process holds a disjoint part of the parameters (FSDP), not a replica.
        histogram_bins: Bins of the output and gradient histograms; 0 for none.
        kwargs: Passed to :class:`torchmetrics.Metric` (e.g. ``process_group``).

    Example:
        >>> from lightning_hookdiag.stats import activation_row
        >>> agg = LayerStatsAggregator(n_layers=2)
        >>> for x in (torch.tensor([1.0, 3.0]), torch.tensor([5.0, 7.0])):  # two micro-batches of layer 0
        ...     _ = activation_row(x, agg.rows("act", [0], x.numel())[0])
        >>> out = agg.pooled()
        >>> out["act_mean"][0].item(), round(out["act_std"][0].item(), 6), out["count"].tolist()
        (4.0, 2.236068, [4.0, 0.0])
    """

    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    act_moments: Tensor
    act_absmax: Tensor
    grad_moments: Tensor
    unit_max: Tensor
    act_hist: Tensor
    grad_hist: Tensor
    param_stats: Tensor
    histogram_edges: Tensor  # a buffer, not a state

    def __init__(
        self,
        n_layers: int,
        n_params: int = 0,
        dtype: torch.dtype = torch.float64,
        sharded_params: bool = False,
        histogram_bins: int = 0,
        **kwargs: Any,
    ) -> None:
        # Rows written by hooks bypass update(), so a cached result could be stale: never cache.
        super().__init__(**{"compute_with_cache": False, **kwargs})
        self.reduce_of: dict[str, str] = {}
        """Each state's reduction (``"sum"`` or ``"max"``), as declared."""
        self.n_layers = n_layers
        self.n_params = n_params
        self.acc_dtype = dtype
        # Replicated parameters (single process, DDP) hold the same value on every process: reduce with max so
        # it is counted once. Sharded ones hold disjoint parts: their sums of squares add up.
        self.add_state("param_stats", torch.zeros(n_params, P_SLOTS, dtype=dtype), "sum" if sharded_params else "max")
        self.add_state("act_moments", torch.zeros(n_layers, ACT_SLOTS, dtype=dtype), dist_reduce_fx="sum")
        # float32, like the other maxima, so that the MAX buffer stays float32 in sharded runs: only float64 outputs
        # beyond float32's range (3.4e38) overflow it, and they are logged as inf with a note (step_notes).
        self.add_state("act_absmax", torch.zeros(n_layers), dist_reduce_fx="max")
        self.add_state("grad_moments", torch.zeros(n_layers, GRAD_SLOTS, dtype=dtype), dist_reduce_fx="sum")
        self.add_state("unit_max", torch.empty(0), dist_reduce_fx="max")
        # A buffer, so that it moves with the states: binning reads it on their device, with no host copy per call.
        # The histogram states exist only when asked for: every state is bytes in the collectives.
        edges = histogram_edges(histogram_bins) if histogram_bins else torch.empty(0)
        self.histogram_edges_host: list[float] = edges.tolist()
        self.register_buffer("histogram_edges", edges, persistent=False)
        self._core = frozenset(self.reduce_of)  # compute() finalises these; it returns every later state as it is
        if histogram_bins:
            self.add_state("act_hist", torch.zeros(n_layers, histogram_bins), dist_reduce_fx="sum")
            self.add_state("grad_hist", torch.zeros(n_layers, histogram_bins), dist_reduce_fx="sum")
        self.sharded_params = sharded_params
        self.unit_layers: frozenset[int] = frozenset(range(n_layers))
        """Layers that may report per-unit maxima: the layout agreement waits for these (see :meth:`track_units`)."""
        self.unit_sizes: list[int] = [0] * n_layers
        """Agreed unit count per layer (0: not known yet), in layer order: the same flat layout on every process."""
        self._unit_offsets: list[int] = [0] * n_layers
        self._unit_owner = torch.empty(0, dtype=torch.long)
        self._pending_units: dict[int, Tensor] = {}
        self._bad_flags: tuple[frozenset[int], Tensor] | None = None
        self._unit_bad: Tensor | None = None
        self.unit_mismatch: set[int] = set()
        """Layers whose unit count changed after it was learned, on this process or (when agreed) between
        processes; their dead fraction is not tracked."""
        self.param_norm_low: Tensor | None = None
        """Smallest weight sum of squares over the processes that measured each replicated parameter (``+inf``
        where none did), from the last sync; ``None`` without one, or for sharded parameters."""
        self.grad_scale: Tensor | None = None
        """AMP loss scale of the step's gradients, divided out of ``act_grad_norm`` at ``compute``."""
        self._synced = False
        self._relaid: Tensor | None = None
        self._orders: LayerOrders | None = None  # this process's, for the next sync (agree_orders)
        self._agreed: Tensor | None = None  # their maxima over processes, from the last sync
        self._calls = {"act": _Calls(ACT_ROW, dtype), "grad": _Calls(GRAD_ROW, dtype), "count": _Calls(0, dtype)}

    def track_units(self, layers: Iterable[int]) -> None:
        """Declare the layers that may report per-unit maxima (default: every layer)."""
        # Until each of them has run somewhere, a sync reads the agreed unit counts back (a small host transfer).
        layers = frozenset(layers)
        if bad := [i for i in layers if not 0 <= i < self.n_layers]:
            raise ValueError(f"track_units: expected layer indices in [0, {self.n_layers}), got {sorted(bad)}")
        self.unit_layers = layers

    def _relayout(self, sizes: dict[int, int]) -> None:
        """Give the layers of ``sizes`` their slots in layer order, keeping the maxima recorded or pending."""
        device = self.unit_max.device
        old_sizes, old_offsets = list(self.unit_sizes), list(self._unit_offsets)
        for layer, size in sizes.items():
            self.unit_sizes[layer] = size
        current, default, offset = [], [], 0
        for layer, size in enumerate(self.unit_sizes):
            self._unit_offsets[layer] = offset
            offset += size
            if not size:
                continue
            # Filled on the device, the default too: reset() copies the default into the state every sampled step.
            fill = torch.full((size,), float("-inf"), dtype=self.unit_max.dtype, device=device)
            default.append(fill)
            if old_sizes[layer]:
                current.append(self.unit_max[old_offsets[layer] : old_offsets[layer] + size])
            elif layer in self._pending_units and self._pending_units[layer].numel() == size:
                current.append(self._pending_units[layer].to(device, self.unit_max.dtype))
            else:
                current.append(fill)
        for layer in sizes:
            self._pending_units.pop(layer, None)
        empty = torch.empty(0, dtype=self.unit_max.dtype, device=device)
        self.add_state("unit_max", torch.cat(default) if default else empty, dist_reduce_fx="max")
        self.unit_max = torch.cat(current) if current else empty
        owners = [torch.full((n,), i, dtype=torch.long, device=device) for i, n in enumerate(self.unit_sizes)]
        self._unit_owner = torch.cat(owners)

    def _add_units(self, layer: int, units: Tensor) -> None:
        if units.dtype.itemsize > self.unit_max.dtype.itemsize:
            # float64 outputs; float32/16 ones promote inside fmax. (A dtype test, not torch.promote_types, which
            # is dispatched like an op on every hooked call.)
            units = units.to(self.unit_max.dtype)
        size = self.unit_sizes[layer]
        if size:
            target = self.unit_max[self._unit_offsets[layer] : self._unit_offsets[layer] + size]
        else:  # not agreed yet: keep this process's maxima aside until the next sync (or compute) gives it slots
            pending = self._pending_units.get(layer)
            if pending is None:
                self._pending_units[layer] = units.to(self.unit_max.dtype).clone()
                return
            target = pending
        if units.numel() != target.numel():
            self.unit_mismatch.add(layer)
            self._pending_units.pop(layer, None)
        else:
            torch.fmax(target, units, out=target)

    def agree_orders(self, orders: LayerOrders) -> None:
        """Agree ``orders`` in the next sync's MAX all-reduce; :meth:`compute` then returns their ``layer_orders``."""
        self._orders = orders

    def rows(self, kind: str, layers: list[int], numel: int) -> Tensor:
        """``len(layers)`` consecutive rows of this step's call table ``kind``, for calls of ``numel`` elements each.

        ``"act"`` rows are :func:`~lightning_hookdiag.stats.activation_row`'s, ``"grad"`` rows ``gradient_row``'s; a
        ``"count"`` row has no column (an output counted without moments).
        """
        return self._calls[kind].rows(layers, numel, self.act_moments.device)

    def add(
        self,
        layer: int | None = None,
        units: Tensor | None = None,
        params: tuple[Tensor, Tensor, int | slice] | None = None,
    ) -> None:
        """Add one observation: the hot path, without the tens of microseconds torchmetrics wraps ``update`` in.

        ``units`` are ``layer``'s per-unit maxima (:func:`~lightning_hookdiag.stats.unit_maxima`); ``params`` is
        ``(index, values, columns)``, written into the parameter rows ``index`` and columns ``columns``
        (:mod:`lightning_hookdiag.params`). Nothing at all is a valid call: a process whose layers did not run still
        takes part in the reduction.
        """
        if params is not None:
            index, values, columns = params
            self.param_stats[:, columns].index_copy_(0, index, values.to(self.param_stats.dtype))
        if units is not None and layer is not None and layer not in self.unit_mismatch:
            if layer not in self.unit_layers:
                raise ValueError(
                    f"units: layer {layer} was not declared with track_units (declared: {sorted(self.unit_layers)})"
                )
            self._add_units(layer, units)

    def add_state(self, name: str, default: Tensor, dist_reduce_fx: str) -> None:  # type: ignore[override]
        """Register a state reduced by ``"sum"`` or ``"max"``: the one place its reduction is declared.

        A component's state rides in the same two all-reduces as the core states, is reset with them, and
        :meth:`compute` returns it unchanged under ``name``. ``default`` is its reset value (see :meth:`new_state`).

        Raises:
            ValueError: For a reduction other than ``"sum"`` or ``"max"``.

        Example:
            >>> agg = LayerStatsAggregator(n_layers=1)
            >>> agg.add_state("calls", agg.new_state(1), "sum")
            >>> agg.pool("calls", torch.ones(1)); agg.pool("calls", torch.ones(1)); agg.calls, agg.reduce_of["calls"]
            (tensor([2.], dtype=torch.float64), 'sum')
            >>> agg.add_state("calls", torch.zeros(1), "mean")
            Traceback (most recent call last):
            ...
            ValueError: add_state('calls'): expected dist_reduce_fx 'sum' or 'max', got 'mean'
        """
        if dist_reduce_fx not in ("sum", "max"):
            raise ValueError(f"add_state({name!r}): expected dist_reduce_fx 'sum' or 'max', got {dist_reduce_fx!r}")
        super().add_state(name, default, dist_reduce_fx=dist_reduce_fx, persistent=False)
        self.reduce_of[name] = dist_reduce_fx

    def new_state(self, *shape: int, fill: float = 0.0, dtype: torch.dtype | None = None) -> Tensor:
        """A ``shape`` tensor of ``fill`` in ``dtype`` (default :attr:`acc_dtype`), on the states' device."""
        return torch.full(shape, fill, dtype=dtype or self.acc_dtype, device=self.act_moments.device)

    def pool(self, name: str, values: Tensor, layer: int | None = None) -> None:
        """Add ``values`` to (``"sum"``) or take the maximum with (``"max"``) state ``name`` (its row ``layer``)."""
        state = getattr(self, name)
        target = state if layer is None else state[layer]
        values = values.to(state.dtype)
        if self.reduce_of[name] == "sum":
            target.add_(values)
        else:
            torch.maximum(target, values, out=target)

    def _fold(self) -> None:
        if (taken := self._calls["act"].take()) is not None:
            rows, index, counts = taken
            moments, absmax = moments_from_rows(rows, counts)
            self.act_moments.index_add_(0, index, moments)
            self.act_absmax.scatter_reduce_(0, index, absmax.to(self.act_absmax.dtype), "amax")
        if (taken := self._calls["grad"].take()) is not None:
            rows, index, counts = taken
            self.grad_moments.index_add_(0, index, gradient_moments_from_rows(rows, counts))
        if (taken := self._calls["count"].take()) is not None:
            _, index, counts = taken
            self.act_moments[:, ACT_COUNT].index_add_(0, index, counts)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`add` through torchmetrics' bookkeeping, once per step; also folds the rows."""
        self.add(*args, **kwargs)
        self._fold()

    def reset(self) -> None:
        """Clear the states and any pending observations, to start the next sampled step (the layout stays)."""
        super().reset()
        for calls in self._calls.values():
            calls.clear()
        self._pending_units = {}
        self._unit_bad = None
        self.param_norm_low = None
        self._orders, self._agreed = None, None

    def sync(self, *args: Any, **kwargs: Any) -> None:
        """Torchmetrics' ``sync``, after the fold, so that the local copy it keeps holds every row."""
        self._fold()
        super().sync(*args, **kwargs)

    def unsync(self, should_unsync: bool = True) -> None:
        """Torchmetrics' ``unsync``; the per-unit maxima keep the layout the sync agreed on."""
        super().unsync(should_unsync)
        if self._relaid is not None:
            self.unit_max, self._relaid = self._relaid, None

    def _sync_dist(self, dist_sync_fn: Any = None, process_group: Any = None) -> None:
        # One SUM and one MAX all_reduce over process_group (default: the metric's); every process must call it, also
        # one whose layers did not run. dist_sync_fn is ignored: a sum and a maximum need no gathered copies.
        group = process_group or self.process_group
        self._synced = True
        # Layers declared for per-unit maxima without an agreed unit count: the same list on every process, because
        # the agreed counts are.
        waiting = [i for i in sorted(self.unit_layers) if not self.unit_sizes[i] and i not in self.unit_mismatch]
        names = {op: [name for name, reduce in self.reduce_of.items() if reduce == op] for op in ("sum", "max")}
        sums = [getattr(self, name) for name in names["sum"]]
        if waiting:
            # (processes that saw the layer, sum of their unit counts, sum of squares): the counts agree exactly
            # when seen * squares == total ** 2.
            sizes = [self._pending_units[i].numel() if i in self._pending_units else 0 for i in waiting]
            claims = [[min(n, 1), n, n * n] for n in sizes]
            sums.append(torch.tensor(claims, dtype=torch.float64, device=self.act_moments.device))
        reduced = all_reduce_packed(sums, "sum", group)
        if waiting:
            agreed: dict[int, int] = {}
            # The one host read of a sync, only while a declared layer waits for its layout (normally the first).
            for layer, (seen, total, squares) in zip(waiting, reduced.pop().tolist(), strict=True):
                if seen and total * total == seen * squares:
                    agreed[layer] = round(total / seen)
                elif seen:
                    self.unit_mismatch.add(layer)  # different counts on different processes
                    self._pending_units.pop(layer, None)
            if agreed:
                self._relayout(agreed)
                self._relaid = self.unit_max  # what unsync restores instead of the local copy's old layout
        maxima = [getattr(self, name) for name in names["max"]]  # read after the relayout: unit_max may be new
        if self.unit_layers:
            maxima.append(self._mismatch_flags())
        low = None
        if not self.sharded_params and self.n_params:  # sharded parameters' parts differ by design
            # Minus each replicated parameter's weight sum of squares (-inf where not measured): its maximum over
            # processes is minus the smallest, so replicas that differ show up in the collective that takes the largest.
            low = torch.where(self.param_stats[:, P_SEEN] > 0, self.param_stats[:, P_WEIGHT_SQ], math.inf).neg()
            maxima.append(low)
        if self._orders is not None:  # a few numbers per layer, in the same collective: no collective per layer
            positions = order_positions(self._orders, self.n_layers)
            maxima.append(host_values(positions, self.act_absmax.dtype, self.act_absmax.device))
        reduced_max = all_reduce_packed(maxima, "max", group)
        if self._orders is not None:
            self._agreed = reduced_max.pop()
        self.param_norm_low = None if low is None else reduced_max.pop().neg()
        if self.unit_layers:
            self._unit_bad = reduced_max.pop()
        for name, value in zip([*names["sum"], *names["max"]], [*reduced, *reduced_max], strict=True):
            setattr(self, name, value)

    def _mismatch_flags(self) -> Tensor:
        # 1 for the layers this process stopped tracking: a maximum over processes makes the decision global. Built
        # again only when the set changes, so that no sync copies host memory to the device.
        key = frozenset(self.unit_mismatch)
        if self._bad_flags is None or self._bad_flags[0] != key or self._bad_flags[1].device != self.unit_max.device:
            flags = torch.zeros(self.n_layers, dtype=self.act_absmax.dtype)
            flags[list(key)] = 1.0
            self._bad_flags = (key, flags.to(self.unit_max.device))
        return self._bad_flags[1]

    def pooled(self) -> dict[str, Tensor]:
        """:meth:`compute` without torchmetrics' clone of every result, for a caller that only reads them."""
        with self.sync_context():
            return LayerStatsAggregator.compute(self)  # the method, not the wrapper torchmetrics sets on the instance

    def compute(self) -> dict[str, Tensor]:
        """Finalised statistics, after torchmetrics has reduced the states over processes.

        Returns:
            ``[n_layers]`` vectors of every activation and gradient statistic, ``act_dead_frac`` (NaN where not
            tracked) and ``count`` / ``grad_count`` (elements observed: 0 means the layer never ran), plus the
            parameter statistics of :func:`~lightning_hookdiag.params.finalize_parameters`; after a sync of
            replicated parameters also ``param_norm_min``, the smallest ``param_norm`` over the processes that
            measured each parameter (``param_norm`` is the largest; ``inf`` where none did); the histograms and every
            state a component registered, unchanged.
        """
        self._fold()  # normally done by update() or the sync; here it would miss the reduction over processes
        synced, self._synced = self._synced, False
        if self._pending_units and not synced:
            # No sync (one process): this process's unit counts are the agreed ones.
            self._relayout({layer: t.numel() for layer, t in self._pending_units.items()})
        out = finalize_activations(self.act_moments, self.act_absmax)
        out.update(finalize_gradients(self.grad_moments, self.grad_scale))
        dead = finalize_dead_fraction(
            self.unit_max, self._unit_owner.to(self.unit_max.device), self.n_layers, self.acc_dtype
        )
        for layer in self.unit_mismatch:  # its units stopped being recorded: the fraction would read "all dead"
            dead[layer] = float("nan")
        if self._unit_bad is not None:  # ... on some other process
            dead = torch.where(self._unit_bad.to(dead.device) > 0, torch.full_like(dead, float("nan")), dead)
        out["act_dead_frac"] = dead
        out.update(count=self.act_moments[:, ACT_COUNT], grad_count=self.grad_moments[:, GRAD_COUNT])
        out.update(finalize_parameters(self.param_stats))
        if self.param_norm_low is not None:  # synced over processes: replicas can be compared
            out["param_norm_min"] = self.param_norm_low.to(self.param_stats.device).sqrt()
        out.update((name, getattr(self, name)) for name in self.reduce_of if name not in self._core)
        if self._agreed is not None:
            out["layer_orders"] = self._agreed
        return out


class _Calls:
    # The rows of one kind of observation in the open step, one per call. The layer index and counts are host lists
    # whose device copies are cached by value: a step repeating the previous one's calls copies nothing.

    __slots__ = ("_patterns", "counts", "layers", "table")

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        self.table = torch.empty(0, width, dtype=dtype)
        self.layers: list[int] = []
        self.counts: list[int] = []
        self._patterns: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Tensor, Tensor]] = {}

    def rows(self, layers: list[int], count: int, device: torch.device) -> Tensor:
        i, k = len(self.layers), len(layers)
        if i + k > self.table.shape[0] or self.table.device != device:
            grown = torch.empty(max(16, 2 * i, i + k), self.table.shape[1], dtype=self.table.dtype, device=device)
            grown[:i].copy_(self.table[:i])
            self.table = grown
        self.layers.extend(layers)
        self.counts.extend([count] * k)
        return self.table[i : i + k]

    def take(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(rows, layer index, counts)`` of the calls since the last take, or ``None``; the calls are cleared."""
        if not self.layers:
            return None
        key = (tuple(self.layers), tuple(self.counts))
        cached = self._patterns.get(key)
        if cached is None or cached[0].device != self.table.device:
            if len(self._patterns) >= 8:  # varying calls (sequence lengths, branches): keep a few recent patterns
                self._patterns = {}
            device = self.table.device
            cached = self._patterns[key] = (
                host_values(key[0], torch.long, device),
                host_values(key[1], self.table.dtype, device),
            )
        rows = self.table[: len(self.layers)]
        self.clear()
        return rows, *cached

    def clear(self) -> None:
        self.layers, self.counts = [], []
