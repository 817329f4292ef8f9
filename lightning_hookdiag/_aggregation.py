"""Exact pooling of per-layer statistics over micro-batches and processes, in torchmetrics state.

The pooled state receives rows: a recorder's finished per-layer tensors (:class:`~lightning_hookdiag._stats.LayerRows`)
and the parameter rows, through ``update``; it never sees a hooked tensor. torchmetrics keeps the states (reset, device
moves, ``compute``); its gather-based sync is replaced by one SUM and one MAX ``all_reduce`` of packed buffers
(``docs/integrations.md#what-is-synced-and-how``). A layer's unit count (``act_dead_frac``) is agreed once in the fit,
through the SUM buffer of the first sync in which any process saw it, so every process has the same layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_hookdiag._distributed import all_reduce_packed
from lightning_hookdiag._params import P_SEEN, P_SLOTS, P_WEIGHT_SQ, finalize_parameters
from lightning_hookdiag._stats import (
    ACT_COUNT,
    ACT_SLOTS,
    GRAD_COUNT,
    GRAD_SLOTS,
    LayerRows,
    finalize_activations,
    finalize_dead_fraction,
    finalize_gradients,
    host_values,
)

__all__ = ["LayerOrders", "LayerStatsAggregator", "UnitLayout", "agreed_orders", "host_values", "order_positions"]

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


class LayerStatsAggregator(Metric):
    """Pooled sufficient statistics of ``n_layers`` modules for one sampled optimizer step.

    Args:
        n_layers: Number of observed modules; rows refer to them by index.
        n_params: Number of observed parameters (:mod:`lightning_hookdiag._params`).
        dtype: Dtype of the additive states (float64 keeps variance pooled from sums exact).
        sharded_params: Each process holds a disjoint part of the parameters (FSDP), not a replica.
        histogram_bins: Bins of the output and gradient histograms; 0 for none.
        unit_layers: Indices of the layers whose rows may hold per-unit maxima (``act_dead_frac``).
        kwargs: Passed to :class:`torchmetrics.Metric` (e.g. ``process_group``).

    Example:
        >>> from lightning_hookdiag._recorder import StepRecorder
        >>> rec, agg = StepRecorder(n_layers=2), LayerStatsAggregator(n_layers=2)
        >>> for x in (torch.tensor([1.0, 3.0]), torch.tensor([5.0, 7.0])):  # two micro-batches of layer 0
        ...     rec.on_tensor(0, x)
        >>> agg.update(rec.take())
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
    unit_bad: Tensor
    layer_orders: Tensor
    act_hist: Tensor
    grad_hist: Tensor
    param_stats: Tensor

    def __init__(
        self,
        n_layers: int,
        n_params: int = 0,
        dtype: torch.dtype = torch.float64,
        sharded_params: bool = False,
        histogram_bins: int = 0,
        unit_layers: Iterable[int] = (),
        **kwargs: Any,
    ) -> None:
        # Components pool into their states outside update(), so a cached result could be stale: never cache.
        super().__init__(**{"compute_with_cache": False, **kwargs})
        unit_layers = frozenset(unit_layers)
        if bad := sorted(i for i in unit_layers if not 0 <= i < n_layers):
            raise ValueError(f"unit_layers: expected layer indices in [0, {n_layers}), got {bad}")
        self.reduce_of: dict[str, str] = {}
        """Each state's reduction (``"sum"`` or ``"max"``), as declared."""
        self.n_layers = n_layers
        self.n_params = n_params
        self.acc_dtype = dtype
        self.sharded_params = sharded_params
        # Replicated parameters (single process, DDP) hold the same value on every process: reduce with max so
        # it is counted once. Sharded ones hold disjoint parts: their sums of squares add up.
        self.add_state("param_stats", torch.zeros(n_params, P_SLOTS, dtype=dtype), "sum" if sharded_params else "max")
        self.add_state("act_moments", torch.zeros(n_layers, ACT_SLOTS, dtype=dtype), dist_reduce_fx="sum")
        # float32, like the other maxima, so that the MAX buffer stays float32 in sharded runs: only float64 outputs
        # beyond float32's range (3.4e38) overflow it, and they are logged as inf with a note (step_notes).
        self.add_state("act_absmax", torch.zeros(n_layers), dist_reduce_fx="max")
        self.add_state("grad_moments", torch.zeros(n_layers, GRAD_SLOTS, dtype=dtype), dist_reduce_fx="sum")
        self.add_state("unit_max", torch.empty(0), dist_reduce_fx="max")
        # A few numbers per layer, in the MAX collective: no collective per layer (agree_orders).
        self.add_state("layer_orders", torch.full((n_layers * ORDER_SLOTS,), -math.inf), dist_reduce_fx="max")
        if unit_layers:  # 1 for a layer some process stopped tracking: the maximum makes the decision global
            self.add_state("unit_bad", torch.zeros(n_layers), dist_reduce_fx="max")
        self._core = frozenset(self.reduce_of)  # compute() finalises these; it returns every later state as it is
        if histogram_bins:  # only when asked for: every state is bytes in the collectives
            self.add_state("act_hist", torch.zeros(n_layers, histogram_bins), dist_reduce_fx="sum")
            self.add_state("grad_hist", torch.zeros(n_layers, histogram_bins), dist_reduce_fx="sum")
        self.unit_layers = unit_layers
        self.layout = UnitLayout(n_layers)
        """The agreed unit counts of the unit layers: the same flat layout of ``unit_max`` on every process."""
        self.unit_mismatch: set[int] = set()
        """Layers whose unit count changed after it was learned, on this process or (when agreed) between
        processes; their dead fraction is not tracked."""
        self.param_norm_low: Tensor | None = None
        """Smallest weight sum of squares over the processes that measured each replicated parameter (``+inf``
        where none did), from the last sync; read only after one, never for sharded parameters."""
        self.grad_scale: Tensor | None = None
        """AMP loss scale of the step's gradients, divided out of ``act_grad_norm`` at ``compute``."""
        self._synced = False  # the states of this compute were reduced over processes (torchmetrics does not say)
        self._pending: dict[int, Tensor] = {}  # units of layers without an agreed count, until the next sync
        self._unit_fill = torch.empty(0)  # -inf in the agreed layout
        self._flags: tuple[frozenset[int], Tensor] | None = None  # unit_bad's value for unit_mismatch, kept

    @property
    def unit_sizes(self) -> list[int]:
        """Agreed unit count per layer (0: not known yet), in layer order."""
        return list(self.layout.sizes)

    def agree_orders(self, orders: LayerOrders) -> None:
        """Agree ``orders`` in the next sync's MAX all-reduce; :meth:`compute` then returns their ``layer_orders``."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return  # no sync will run: one process's orders are its own
        positions = order_positions(orders, self.n_layers)
        self.pool("layer_orders", host_values(positions, self.layer_orders.dtype, self.layer_orders.device))

    def update(self, rows: LayerRows | None = None, params: tuple[Tensor, Tensor, int | slice] | None = None) -> None:
        """Pool one step's ``rows`` (:meth:`~lightning_hookdiag._recorder.StepRecorder.take`) and parameter rows.

        ``params`` is ``(index, values, columns)``, written into the parameter rows ``index`` and columns ``columns``
        (:mod:`lightning_hookdiag._params`). Nothing at all is a valid call: a process whose layers did not run still
        takes part in the reduction.
        """
        if params is not None:
            index, values, columns = params
            self.param_stats[:, columns].index_copy_(0, index, values.to(self.param_stats.dtype))
        if rows is None:
            return
        self.act_moments.add_(rows.act_moments)
        torch.maximum(self.act_absmax, rows.act_absmax.to(self.act_absmax.dtype), out=self.act_absmax)
        self.grad_moments.add_(rows.grad_moments)
        for name, hist in (("act_hist", rows.act_hist), ("grad_hist", rows.grad_hist)):
            if hist is not None:
                self.pool(name, hist)
        self.unit_mismatch |= rows.unit_mismatch
        if rows.units:
            self._add_units(rows.units)
        if self.unit_mismatch:  # no flag set: the reset value already says so, without an op
            self.pool("unit_bad", self._mismatch_flags())

    def _add_units(self, units: dict[int, Tensor]) -> None:
        """Pool per-unit maxima into their agreed slots in two ops, whatever the number of layers; keep the others."""
        if bad := sorted(set(units) - self.unit_layers):
            raise ValueError(f"units: layer {bad[0]} is not one of unit_layers ({sorted(self.unit_layers)})")
        # Layers laid out take their slots (-inf, the reset value, for those that did not run); one without an
        # agreed count waits for the next sync (or compute), aside.
        parts = []
        for layer in self.layout.laid_out():
            size, offset = self.layout.sizes[layer], self.layout.offsets[layer]
            held = units.get(layer)
            if held is not None and held.numel() != size and layer not in self.unit_mismatch:
                self.unit_mismatch.add(layer)  # another process saw another count first
            if held is None or layer in self.unit_mismatch:
                held = self._unit_fill[offset : offset + size]
            parts.append(held)
        if parts:
            torch.fmax(self.unit_max, torch.cat(parts), out=self.unit_max)
        for layer, held in units.items():
            if self.layout.sizes[layer] or layer in self.unit_mismatch:
                continue
            pending = self._pending.get(layer)
            if pending is None:
                self._pending[layer] = held
            elif pending.numel() != held.numel():
                self.unit_mismatch.add(layer)
                del self._pending[layer]
            else:
                self._pending[layer] = torch.fmax(pending, held)  # a new tensor: the rows stay as handed over

    def _mismatch_flags(self) -> Tensor:
        # Built again only when the set changes, so that no step copies host memory to the device.
        key = frozenset(self.unit_mismatch)
        if self._flags is None or self._flags[0] != key or self._flags[1].device != self.unit_bad.device:
            flags = torch.zeros(self.n_layers, dtype=self.unit_bad.dtype)
            flags[list(key)] = 1.0
            self._flags = (key, flags.to(self.unit_bad.device))
        return self._flags[1]

    def reset(self) -> None:
        """Clear the states for the next sampled step, and the per-unit maxima still waiting for their layout."""
        super().reset()
        self._pending = {}

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

    def _lay_out(self, sizes: dict[int, int]) -> None:
        """Give the layers of ``sizes`` their agreed slots, keeping the maxima recorded or pending."""
        old = self.unit_max
        kept = self.layout.extend(sizes, old, self._pending)
        self._pending = {}
        default = torch.full((self.layout.total,), -math.inf, dtype=old.dtype, device=old.device)
        # The new default is what reset() copies into the state from the next step on.
        self.add_state("unit_max", default, dist_reduce_fx="max")
        self.unit_max = kept
        self._unit_fill = default.clone()  # read-only slots of the layers that did not run, in _add_units

    def _sync_dist(self, dist_sync_fn: Any = None, process_group: Any = None) -> None:
        # One SUM and one MAX all_reduce over process_group (default: the metric's); every process must call it, also
        # one whose layers did not run. dist_sync_fn is ignored: a sum and a maximum need no gathered copies.
        group = process_group or self.process_group
        self._synced = True
        names = {op: [name for name, reduce in self.reduce_of.items() if reduce == op] for op in ("sum", "max")}
        # Unit layers without an agreed count (the same list on every process, as the agreed counts are): their
        # claims ride in the SUM buffer, until each has run somewhere.
        waiting = [i for i in sorted(self.unit_layers) if not self.layout.sizes[i] and i not in self.unit_mismatch]
        claims = [self._pending[i].numel() if i in self._pending else 0 for i in waiting]
        extra = [self.layout.claims(claims, self.act_moments.device)] if waiting else []
        reduced = all_reduce_packed([*(getattr(self, name) for name in names["sum"]), *extra], "sum", group)
        if waiting:
            self._settle(waiting, reduced.pop())
        maxima = [getattr(self, name) for name in names["max"]]  # read after the layout: unit_max may be new
        low = None
        if not self.sharded_params and self.n_params:  # sharded parameters' parts differ by design
            # Minus each replicated parameter's weight sum of squares (-inf where not measured): its maximum over
            # processes is minus the smallest, so replicas that differ show up in the collective that takes the largest.
            low = torch.where(self.param_stats[:, P_SEEN] > 0, self.param_stats[:, P_WEIGHT_SQ], math.inf).neg()
            maxima.append(low)
        reduced_max = all_reduce_packed(maxima, "max", group)
        if low is not None:
            self.param_norm_low = reduced_max.pop().neg()
        for name, value in zip([*names["sum"], *names["max"]], [*reduced, *reduced_max], strict=True):
            setattr(self, name, value)

    def _settle(self, waiting: list[int], reduced_claims: Tensor) -> None:
        # The one host read of a sync, only while a unit layer waits for its count (normally only the first sync).
        agreed, differ = UnitLayout.agreed(waiting, reduced_claims.tolist())
        for layer in differ:  # different counts on different processes
            self.unit_mismatch.add(layer)
            self._pending.pop(layer, None)
        if agreed:
            self._lay_out(agreed)

    def pooled(self) -> dict[str, Tensor]:
        """:meth:`compute` without torchmetrics' clone of every result, for a caller that only reads them."""
        with self.sync_context():
            return LayerStatsAggregator.compute(self)  # the method, not the wrapper torchmetrics sets on the instance

    def compute(self) -> dict[str, Tensor]:
        """Finalised statistics, after torchmetrics has reduced the states over processes.

        Returns:
            ``[n_layers]`` vectors of every activation and gradient statistic, ``act_dead_frac`` (NaN where not
            tracked) and ``count`` / ``grad_count`` (elements observed: 0 means the layer never ran), plus the
            parameter statistics of :func:`~lightning_hookdiag._params.finalize_parameters`; after a sync also
            ``layer_orders`` (:func:`agreed_orders`) and, for replicated parameters, ``param_norm_min``, the smallest
            ``param_norm`` over the processes that measured each parameter (``param_norm`` is the largest; ``inf``
            where none did); the histograms and every state a component registered, unchanged.
        """
        synced, self._synced = self._synced, False
        if self._pending and not synced:  # no sync (one process): this process's unit counts are the agreed ones
            self._lay_out({layer: t.numel() for layer, t in self._pending.items()})
        out = finalize_activations(self.act_moments, self.act_absmax)
        out.update(finalize_gradients(self.grad_moments, self.grad_scale))
        owner = self.layout.owner.to(self.unit_max.device)
        dead = finalize_dead_fraction(self.unit_max, owner, self.n_layers, self.acc_dtype)
        for layer in self.unit_mismatch:  # its units stopped being recorded: the fraction would read "all dead"
            dead[layer] = float("nan")
        if self.unit_layers:  # ... on some process
            dead = torch.where(self.unit_bad.to(dead.device) > 0, torch.full_like(dead, float("nan")), dead)
        out["act_dead_frac"] = dead
        out.update(count=self.act_moments[:, ACT_COUNT], grad_count=self.grad_moments[:, GRAD_COUNT])
        out.update(finalize_parameters(self.param_stats))
        if synced and self.param_norm_low is not None:  # reduced over processes: replicas can be compared
            out["param_norm_min"] = self.param_norm_low.to(self.param_stats.device).sqrt()
        out.update((name, getattr(self, name)) for name in self.reduce_of if name not in self._core)
        if synced:
            out["layer_orders"] = self.layer_orders
        return out


class UnitLayout:
    """The agreed unit counts of the unit layers, laid out flat in layer order: ``unit_max``'s layout.

    Each layer's count is agreed once in the fit, in the first sync in which some process saw it; a layer that no
    process has run yet has none (0) and no slots.
    """

    def __init__(self, n_layers: int) -> None:
        self.sizes: list[int] = [0] * n_layers
        self.offsets: list[int] = [0] * n_layers
        self.total = 0
        self.owner = torch.empty(0, dtype=torch.long)
        """The layer of each slot."""

    @staticmethod
    def claims(sizes: list[int], device: torch.device) -> Tensor:
        """Each waiting layer's claim ``(seen here, count, count ** 2)``, summed over processes by the SUM buffer."""
        # float64 on the device, like the sums it rides with; the counts agree exactly when seen * squares == total**2
        return torch.tensor([[min(n, 1), n, n * n] for n in sizes], dtype=torch.float64, device=device)

    @staticmethod
    def agreed(waiting: list[int], summed: list[list[float]]) -> tuple[dict[int, int], list[int]]:
        """``({layer: agreed count}, [layers seen with different counts])`` from the summed claims of ``waiting``."""
        agreed, differ = {}, []
        for layer, (seen, total, squares) in zip(waiting, summed, strict=True):
            if seen and total * total == seen * squares:
                agreed[layer] = round(total / seen)
            elif seen:
                differ.append(layer)
        return agreed, differ

    def laid_out(self) -> list[int]:
        """The layers with an agreed count, in layer order (the order of their slots)."""
        return [layer for layer, size in enumerate(self.sizes) if size]

    def extend(self, sizes: dict[int, int], held: Tensor, pending: dict[int, Tensor]) -> Tensor:
        """Lay out the layers of ``sizes`` too; returns ``held`` (in the old layout) moved to the new one.

        The new layers' slots hold their ``pending`` maxima where their count matches, else ``-inf``.
        """
        old_sizes, old_offsets = list(self.sizes), list(self.offsets)
        for layer, size in sizes.items():
            self.sizes[layer] = size
        parts, offset = [], 0
        for layer, size in enumerate(self.sizes):
            self.offsets[layer] = offset
            offset += size
            if not size:
                continue
            units = pending.get(layer)
            if old_sizes[layer]:
                parts.append(held[old_offsets[layer] : old_offsets[layer] + size])
            elif units is not None and units.numel() == size:
                parts.append(units.to(held.device, held.dtype))
            else:
                parts.append(torch.full((size,), -math.inf, dtype=held.dtype, device=held.device))
        self.total = offset
        # Filled on the device: no host data is copied there.
        owners = [torch.full((n,), i, dtype=torch.long, device=held.device) for i, n in enumerate(self.sizes)]
        self.owner = torch.cat(owners)
        return torch.cat(parts) if parts else held.new_empty(0)
