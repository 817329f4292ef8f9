"""The sinks a :class:`~lightning_hookdiag._hooks.HookSet` writes into: outputs and gradients to one step's rows.

The recorder owns everything it fills. Each observed tensor goes once to
:func:`~lightning_hookdiag._stats.reduce_tensor` (with a fast path, to
:meth:`~lightning_hookdiag._onepass.OnePass.reduce_tensor`, the same inputs and outputs), which writes its rows into
the recorder's own call table and returns its per-unit maxima and histogram counts, which the recorder keeps too.
At the step's end :meth:`StepRecorder.take` folds them into finished per-layer tensors, a
:class:`~lightning_hookdiag._stats.LayerRows`, which the owner hands to the pooled state: nothing is written into the
pooled state from a hook, and nothing in it calls back here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_hookdiag import _stats as stats
from lightning_hookdiag._stats import (
    ACT_COUNT,
    ACT_ROW,
    ACT_SLOTS,
    GRAD_ROW,
    GRAD_SLOTS,
    LayerRows,
    Workspace,
    activation_row,
    gradient_moments_from_rows,
    gradient_row,
    histogram_edges,
    moments_from_rows,
    piece_sizes,
    reduce_tensor,
)
from lightning_hookdiag.components import Component

if TYPE_CHECKING:  # a type only: the owner builds the reduction and hands it in
    from lightning_hookdiag._onepass import OnePass

__all__ = ["SMALL_ELEMENTS", "StepRecorder"]

SMALL_ELEMENTS = 1 << 16
"""Outputs and gradients of at most this many elements are stacked and reduced a stack at a time (``stack_small``)."""

_MAX_STACKS = 8
_STACKABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# What an ordinary tensor runs its ops through; a subclass with a dispatch of its own wraps other tensors (DTensor).
_PLAIN_DISPATCH = Tensor.__torch_dispatch__


def _stackable(tensor: Tensor) -> bool:
    # A stack holds at least one tensor within the reductions' piece limit (CHUNK_ELEMENTS, read at run time).
    return tensor.numel() <= min(SMALL_ELEMENTS, stats.CHUNK_ELEMENTS) and tensor.dtype in _STACKABLE


class _CallTable:
    """The rows of one kind of observation in the open step, one per reduced piece, with their layers and counts.

    Rows are handed out from blocks that are never reallocated: a view handed out stays valid until :meth:`take`,
    whatever is reserved after it. A step that outgrew its block has its blocks merged at :meth:`take` into one of the
    total size, which the next steps reuse. The layer index and counts are host lists whose device copies are cached
    by value: a step repeating the previous one's calls copies nothing.
    """

    __slots__ = ("_blocks", "_patterns", "dtype", "width")

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        self.width, self.dtype = width, dtype
        self._blocks: list[tuple[Tensor, list[int], list[int]]] = []  # (rows, their layers, their counts)
        self._patterns: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Tensor, Tensor]] = {}

    def reserve(self, layers: list[int], counts: list[int], device: torch.device) -> Tensor:
        """``len(layers)`` consecutive rows for calls of ``layers`` with ``counts`` elements each, to be written."""
        k = len(layers)
        if not self._blocks or len(self._blocks[-1][1]) + k > self._blocks[-1][0].shape[0]:
            held = sum(block.shape[0] for block, _, _ in self._blocks)
            self._blocks.append((self._block(max(16, held, k), device), [], []))
        block, held_layers, held_counts = self._blocks[-1]
        i = len(held_layers)
        held_layers.extend(layers)
        held_counts.extend(counts)
        return block[i : i + k]

    def _block(self, rows: int, device: torch.device) -> Tensor:
        return torch.empty(rows, self.width, dtype=self.dtype, device=device)

    def take(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(rows, layer index, counts)`` of the calls since the last take, or ``None``; the table starts over.

        The rows are read before anything is reserved again (their block is reused).
        """
        layers = [layer for _, held, _ in self._blocks for layer in held]
        if not layers:
            return None
        counts = [count for _, _, held in self._blocks for count in held]
        block = self._blocks[0][0]
        if len(self._blocks) > 1:  # outgrown: one block of the total size from now on
            block = self._block(sum(b.shape[0] for b, _, _ in self._blocks), block.device)
            torch.cat([b[: len(held)] for b, held, _ in self._blocks], out=block[: len(layers)])
        self._blocks = [(block, [], [])]
        key = (tuple(layers), tuple(counts))
        cached = self._patterns.get(key)
        if cached is None or cached[0].device != block.device:
            if len(self._patterns) >= 8:  # varying calls (sequence lengths, branches): keep a few recent patterns
                self._patterns = {}
            cached = self._patterns[key] = (
                stats.host_values(key[0], torch.long, block.device),
                stats.host_values(key[1], self.dtype, block.device),
            )
        return block[: len(layers)], *cached

    def holds_rows(self) -> bool:
        """Whether any row was reserved since the last take."""
        return any(held for _, held, _ in self._blocks)

    def clear(self) -> None:
        """Forget the rows (of a discarded window)."""
        self._blocks = self._blocks[-1:]
        if self._blocks:
            self._blocks = [(self._blocks[0][0], [], [])]


class _Stacks:
    """Small tensors of one kind, copied into stacks of equal size and reduced one stack at a time.

    On a model of many small layers the fixed cost of each reduction op, a kernel launch on an accelerator, is what a
    sampled step pays for. A copy into the next row of a stack is one op; the full stack (or, at the step's end, the
    rows filled) is reduced in the ops of one tensor into rows of ``table``. Copies, not references: an output can be
    changed in place after its hook ran (``ReLU(inplace=True)``).
    """

    def __init__(self, grad: bool, table: _CallTable, device: torch.device) -> None:
        self._reduce = gradient_row if grad else activation_row
        self._table = table
        self._rows_device = device
        self._buffers: dict[tuple[torch.dtype, int, torch.device], Tensor] = {}
        self._layers: dict[tuple[torch.dtype, int, torch.device], list[int]] = {}

    def add(self, layer: int, tensor: Tensor, workspace: Workspace) -> None:
        key = (tensor.dtype, tensor.numel(), tensor.device)
        buffer = self._buffers.get(key)
        if buffer is None:
            if len(self._buffers) >= _MAX_STACKS:  # many shapes: reduce what is held and start over
                self.flush(workspace)
                self.release()
            rows = max(1, stats.CHUNK_ELEMENTS // tensor.numel())
            buffer = self._buffers[key] = torch.empty(rows, tensor.numel(), dtype=tensor.dtype, device=tensor.device)
            self._layers[key] = []
        layers = self._layers[key]
        buffer[len(layers)].view(tensor.shape).copy_(tensor.detach())
        layers.append(layer)
        if len(layers) == buffer.shape[0]:
            self.flush(workspace, [key])

    def flush(self, workspace: Workspace, keys: list[tuple[torch.dtype, int, torch.device]] | None = None) -> None:
        for key in list(self._layers) if keys is None else keys:
            layers = self._layers[key]
            if layers:
                out = self._table.reserve(layers, [key[1]] * len(layers), self._rows_device)
                self._reduce(self._buffers[key][: len(layers)], out, workspace, dim=1)
                self._layers[key] = []

    def release(self) -> None:
        self._buffers, self._layers = {}, {}


class StepRecorder:
    """The sinks a :class:`~lightning_hookdiag._hooks.HookSet` writes into, with no host read; owner of what they fill.

    Args:
        n_layers: Number of observed modules; the sinks refer to them by index.
        moments: Reduce outputs to activation moments (for ``act_mean``, ``act_std``, ...).
        unit_layers: Indices of layers whose per-unit activity is tracked (``act_dead_frac``).
        unit_dim: Override of the unit axis, see :func:`~lightning_hookdiag._stats.unit_maxima`.
        names: Layer names, for error messages (``unit_dim`` out of range for a layer's output).
        stack_small: Stack outputs and gradients of at most :data:`SMALL_ELEMENTS` elements and reduce them a stack
            at a time (one copy per tensor instead of 10 or 8 ops); :meth:`take` reduces what is still stacked.
        components: Their ``on_output`` / ``on_grad`` sinks receive every observed output and gradient after the
            default statistics, while they are attached.
        histogram_bins: Bins of the output and gradient histograms (:func:`~lightning_hookdiag._stats.histogram_edges`);
            0 for none. A step bins only while :attr:`histograms` is set.
        dtype: Dtype of the rows and of the additive per-layer sums (float64 keeps variance pooled from sums exact).
        device: Where the rows and per-layer tensors live: the pooled state's device.
        fast: The one-pass reduction of large outputs (:class:`~lightning_hookdiag._onepass.OnePass`), given the shifts
            of :meth:`set_shifts`; ``None``: every tensor on :func:`~lightning_hookdiag._stats.reduce_tensor`.

    Example:
        >>> rec = StepRecorder(2)
        >>> for x in (torch.tensor([1.0, 3.0]), torch.tensor([5.0, 7.0])):  # two micro-batches of layer 0
        ...     rec.on_tensor(0, x)
        >>> rows = rec.take()
        >>> rows.act_moments[0].tolist(), rows.act_absmax.tolist()  # count, non-zero, non-zero finite, sum, sum of sq.
        ([4.0, 4.0, 4.0, 16.0, 84.0], [7.0, 0.0])
    """

    def __init__(
        self,
        n_layers: int,
        moments: bool = True,
        unit_layers: frozenset[int] = frozenset(),
        unit_dim: int | None = None,
        names: list[str] | None = None,
        stack_small: bool = False,
        components: Sequence[Component] = (),
        histogram_bins: int = 0,
        dtype: torch.dtype = torch.float64,
        device: torch.device | None = None,
        fast: OnePass | None = None,
    ) -> None:
        if bad := sorted(i for i in unit_layers if not 0 <= i < n_layers):
            raise ValueError(f"unit_layers: expected layer indices in [0, {n_layers}), got {bad}")
        self.n_layers = n_layers
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else device
        # Only attached components get tensors: those that do not watch replays are not attached during one.
        # Each with its sink, which components set in their constructors.
        self._output_sinks = [(c, c.on_output) for c in components if c.on_output is not None]
        self._grad_sinks = [(c, c.on_grad) for c in components if c.on_grad is not None]
        self._tables = {"act": _CallTable(ACT_ROW, dtype), "grad": _CallTable(GRAD_ROW, dtype)}
        self._counts = _CallTable(0, dtype)  # outputs counted without moments: a row of no column per call
        self._stacks = {
            kind: _Stacks(kind == "grad", table, self.device) for kind, table in self._tables.items() if stack_small
        }
        self.moments = moments
        self.unit_layers = unit_layers
        self.unit_dim = unit_dim
        self.names = names
        edges = histogram_edges(histogram_bins) if histogram_bins else torch.empty(0)
        self.histogram_edges_host: list[float] = edges.tolist()
        """The histograms' inner bin edges, as logged with them."""
        self._edges = edges.to(self.device)  # binning reads them on the statistics' device: no host copy per call
        self.histograms = False
        """Whether outputs and gradients are also binned into histograms (set per step by the owner)."""
        self._hist: dict[str, Tensor] = {}  # this step's counts per kind, [n_layers, bins]
        self.unit_sizes: dict[int, int] = {}
        """Each unit layer's unit count, as first seen on this process (the pooled state agrees them over processes)."""
        self.unit_mismatch: set[int] = set()
        """Layers whose unit count changed after it was first seen here; their units are no longer recorded."""
        self._units: dict[int, Tensor] = {}  # this step's per-unit maxima (float32, fmax over calls)
        self.no_float_output: set[int] = set()
        """Layers whose output held no floating-point tensor (nothing to observe)."""
        self.empty_output: set[int] = set()
        """Layers with a call whose output had no elements (skipped: there is nothing to reduce)."""
        self.sparse_output: set[int] = set()
        """Layers whose output (or its gradient) was a sparse tensor (skipped, like integer outputs)."""
        self.nested_output: set[int] = set()
        """Layers whose output (or its gradient) was a nested tensor, strided or jagged layout (skipped)."""
        self.opaque_output: dict[int, str] = {}
        """Layers whose output (or its gradient) held no values to read (meta, ``DTensor``), with what it was."""
        self.workspace = Workspace()
        """Scratch memory of the reductions; the owner releases it at the end of each sampled step."""
        self.fast = fast
        self._shifts: list[Tensor | None] = [None] * n_layers  # each layer's last pooled mean, a [1] device view

    def set_shifts(self, means: Tensor, pooled: Sequence[bool]) -> None:
        """The layers' last pooled ``act_mean`` (``[n_layers]``, on the device), for the layers where ``pooled``.

        The fast path takes each output's sums around its layer's shift; a layer with none yet takes today's path.
        """
        views = means.detach().to(torch.float64).view(-1, 1).unbind()  # [1] views (OnePass reads them), in one call
        self._shifts = [view if seen else None for view, seen in zip(views, pooled, strict=True)]

    def _check_unit_dim(self, layer: int, tensor: Tensor) -> None:
        unit_dim = self.unit_dim
        if unit_dim is not None and tensor.ndim and not -tensor.ndim <= unit_dim < tensor.ndim:
            name = self.names[layer] if self.names else f"#{layer}"
            raise ValueError(
                f"unit_dim: {unit_dim} is out of range for the {tensor.ndim}-D output of {name!r} (shape"
                f" {tuple(tensor.shape)}); expected an axis in [{-tensor.ndim}, {tensor.ndim - 1}] or None"
            )

    def _reduce(self, kind: str, layer: int, tensor: Tensor, units: bool = False) -> None:
        # Rows: stacked small tensors reach the table at the stack's flush, the rest a row per piece here.
        if units:
            self._check_unit_dim(layer, tensor)
        stacks = self._stacks.get(kind)
        rows = False  # this call's rows come from the call table
        if kind == "act" and not self.moments:
            self._counts.reserve([layer], [tensor.numel()], self.device)
        elif stacks is not None and _stackable(tensor):
            stacks.add(layer, tensor, self.workspace)
        else:
            rows = True
        edges = self._edges if self.histograms else None
        maxima, hist = self._reduce_tensor(kind, layer, tensor, rows, units, edges)
        if maxima is not None:
            self._keep_units(layer, maxima)
        if hist is not None:
            self._histogram(kind)[layer].add_(hist)

    def _reduce_tensor(
        self, kind: str, layer: int, tensor: Tensor, rows: bool, units: bool, edges: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """Every reduction of one tensor, on the fast path where it applies: ``(unit maxima, histogram counts)``.

        Args:
            kind: ``"act"`` or ``"grad"``.
            layer: The layer's index.
            tensor: The output or gradient.
            rows: Its rows go to the call table (it is neither stacked nor only counted).
            units: Also its per-unit maxima.
            edges: The histogram's inner edges, ``None``: no histogram.
        """
        grad = kind == "grad"
        table = self._tables[kind]
        if self.fast is None:
            out = None
            if rows:
                sizes = piece_sizes(tensor)
                out = table.reserve([layer] * len(sizes), sizes, self.device)
            return reduce_tensor(tensor, out, self.workspace, grad, units, self.unit_dim, edges)

        def reserve(sizes: list[int]) -> Tensor:  # asked once, with the pieces of the path taken
            return table.reserve([layer] * len(sizes), sizes, self.device)

        shift = None if grad else self._shifts[layer]
        return self.fast.reduce_tensor(
            tensor, reserve if rows else None, self.workspace, grad, units, self.unit_dim, edges, shift=shift
        )

    def _histogram(self, kind: str) -> Tensor:
        hist = self._hist.get(kind)
        if hist is None:
            bins = self._edges.numel() + 1
            hist = self._hist[kind] = torch.zeros(self.n_layers, bins, device=self.device)
        return hist

    def _keep_units(self, layer: int, maxima: Tensor) -> None:
        if layer in self.unit_mismatch:
            return
        size = self.unit_sizes.setdefault(layer, maxima.numel())
        if maxima.numel() != size:
            self.unit_mismatch.add(layer)
            self._units.pop(layer, None)
            return
        held = self._units.get(layer)
        if held is None:
            # float32, like the pooled maxima: float64 outputs narrow (beyond float32's range, to inf: a note says
            # so), float16 ones widen exactly. unit_maxima returns a new tensor: no copy needed to keep it.
            self._units[layer] = maxima.to(torch.float32)
        else:
            torch.fmax(held, maxima, out=held)

    def on_tensor(self, layer: int, tensor: Tensor | None) -> None:
        """Forward sink: observe the first floating-point tensor of layer ``layer``'s output (``None``: none)."""
        if tensor is None:
            self.no_float_output.add(layer)
        elif self._skipped(layer, tensor):
            return
        elif not tensor.numel():
            self.empty_output.add(layer)
        else:
            self._reduce("act", layer, tensor, layer in self.unit_layers)
            for c, sink in self._output_sinks:
                if c.attached:
                    sink(layer, tensor)

    def on_grad(self, layer: int, grad: Tensor) -> None:
        """Gradient sink: observe the gradient of the loss w.r.t. the output of layer ``layer``."""
        if self._skipped(layer, grad):
            return
        if grad.numel():
            self._reduce("grad", layer, grad)
            for c, sink in self._grad_sinks:
                if c.attached:
                    sink(layer, grad)

    def _skipped(self, layer: int, tensor: Tensor) -> bool:
        """Note and skip a tensor the reductions cannot read; attribute checks only, so no kernel on any tensor.

        Nested comes first: a jagged nested tensor has a layout of its own too. A meta tensor has no data; a subclass
        that dispatches its own operations (``DTensor``: a shard, or partial sums of one) gives them its own meaning.
        """
        kind = type(tensor)
        if tensor.is_nested:
            self.nested_output.add(layer)
        elif tensor.layout != torch.strided:
            self.sparse_output.add(layer)
        elif tensor.is_meta:
            self.opaque_output[layer] = "a meta tensor (no data)"
        elif kind is not Tensor and kind.__torch_dispatch__ is not _PLAIN_DISPATCH:
            self.opaque_output[layer] = f"a {kind.__name__}, a tensor subclass that dispatches its own operations"
        else:
            return False
        return True

    def take(self) -> LayerRows | None:
        """This step's statistics of every layer as finished per-layer tensors; the recorder starts the next step empty.

        Reduces what is still stacked, then folds the call rows in a constant number of ops. A layer that did not run
        has zero counts; ``None`` when nothing at all was observed (a window of parameters only): no op at all.
        """
        for stacks in self._stacks.values():
            stacks.flush(self.workspace)
        tables = (*self._tables.values(), self._counts)
        if not (self._units or self._hist or any(table.holds_rows() for table in tables)):
            return None
        act = torch.zeros(self.n_layers, ACT_SLOTS, dtype=self.dtype, device=self.device)
        absmax = torch.zeros(self.n_layers, device=self.device)
        grad = torch.zeros(self.n_layers, GRAD_SLOTS, dtype=self.dtype, device=self.device)
        taken_act = self._tables["act"].take()
        if taken_act is not None:
            rows, index, counts = taken_act
            moments, row_absmax = moments_from_rows(rows, counts)
            act.index_add_(0, index, moments)
            absmax.scatter_reduce_(0, index, row_absmax.to(absmax.dtype), "amax")
        taken_counts = self._counts.take()
        if taken_counts is not None:
            act[:, ACT_COUNT].index_add_(0, taken_counts[1], taken_counts[2])
        taken_grad = self._tables["grad"].take()
        if taken_grad is not None:
            rows, index, counts = taken_grad
            grad.index_add_(0, index, gradient_moments_from_rows(rows, counts))
        taken = LayerRows(
            act_moments=act,
            act_absmax=absmax,
            grad_moments=grad,
            units=self._units,
            unit_mismatch=frozenset(self.unit_mismatch),
            act_hist=self._hist.get("act"),
            grad_hist=self._hist.get("grad"),
        )
        self._units, self._hist = {}, {}
        return taken

    def release(self) -> None:
        """End of a window (logged or discarded): drop its rows, release the scratch memory, forget what was skipped."""
        for table in (*self._tables.values(), self._counts):
            table.clear()
        for stacks in self._stacks.values():
            stacks.release()
        self._units, self._hist = {}, {}
        self.workspace.release()
        for skipped in (self.no_float_output, self.empty_output, self.sparse_output, self.nested_output):
            skipped.clear()
        self.opaque_output.clear()
