"""The sinks a :class:`~lightning_hookdiag.hooks.HookSet` writes into: outputs and gradients to statistics.

:class:`StepRecorder` reduces each observed tensor where it lives (:func:`~lightning_hookdiag.stats.activation_row`,
:func:`~lightning_hookdiag.stats.gradient_row`) into a row of the
:class:`~lightning_hookdiag.aggregation.LayerStatsAggregator`'s call table, which folds them once per step. It holds
no observation itself, and the aggregator does not call back into it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_hookdiag import stats
from lightning_hookdiag.aggregation import LayerStatsAggregator
from lightning_hookdiag.components import Component
from lightning_hookdiag.stats import (
    Workspace,
    activation_row,
    activation_rows,
    chunks,
    gradient_row,
    gradient_rows,
    histogram_counts,
    unit_maxima,
)

__all__ = ["SMALL_ELEMENTS", "StepRecorder"]

SMALL_ELEMENTS = 1 << 16
"""Outputs and gradients of at most this many elements are stacked and reduced a stack at a time (``stack_small``)."""

_MAX_STACKS = 8
_STACKABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _stackable(tensor: Tensor) -> bool:
    # A stack holds at least one tensor within the reductions' piece limit (CHUNK_ELEMENTS, read at run time).
    return tensor.numel() <= min(SMALL_ELEMENTS, stats.CHUNK_ELEMENTS) and tensor.dtype in _STACKABLE


class _Stacks:
    """Small tensors of one kind, copied into stacks of equal size and reduced one stack at a time.

    On a model of many small layers the fixed cost of each reduction op, a kernel launch on an accelerator, is what a
    sampled step pays for: 9 ops per output and 6 per gradient. A copy into the next row of a stack is one op; the
    stack is reduced by :func:`~lightning_hookdiag.stats.activation_rows` (or ``gradient_rows``) in the same 9 (6)
    ops, once it is full or the step ends. A stack holds at most :data:`~lightning_hookdiag.stats.CHUNK_ELEMENTS`
    elements and at most 8 stacks are kept, so the copies stay bounded; they are copies, not references, because an
    output can be changed in place after its hook ran (``ReLU(inplace=True)``).
    """

    def __init__(
        self, reduce: Callable[[Tensor, Tensor, Workspace], Tensor], rows: Callable[[list[int], int], Tensor]
    ) -> None:
        self._reduce = reduce
        self._rows = rows
        self._buffers: dict[tuple[torch.dtype, int, torch.device], Tensor] = {}
        self._layers: dict[tuple[torch.dtype, int, torch.device], list[int]] = {}

    def add(self, layer: int, tensor: Tensor, workspace: Workspace) -> None:
        key = (tensor.dtype, tensor.numel(), tensor.device)
        buffer = self._buffers.get(key)
        if buffer is None:
            if len(self._buffers) >= _MAX_STACKS:  # many shapes: reduce what is held and start over
                self.flush(workspace)
                self._buffers, self._layers = {}, {}
            rows = max(1, stats.CHUNK_ELEMENTS // tensor.numel())
            buffer = self._buffers[key] = torch.empty(rows, tensor.numel(), dtype=tensor.dtype, device=tensor.device)
            self._layers[key] = []
        layers = self._layers[key]
        buffer[len(layers)].view(tensor.shape).copy_(tensor.detach())
        layers.append(layer)
        if len(layers) == buffer.shape[0]:
            self._flush(key, workspace)

    def _flush(self, key: tuple[torch.dtype, int, torch.device], workspace: Workspace) -> None:
        layers = self._layers[key]
        if layers:
            self._reduce(self._buffers[key][: len(layers)], self._rows(layers, key[1]), workspace)
            self._layers[key] = []

    def flush(self, workspace: Workspace) -> None:
        """Reduce every stack (the rows reach the aggregator's call table)."""
        for key in list(self._layers):
            self._flush(key, workspace)

    def release(self) -> None:
        """Drop the stacks and what they hold."""
        self._buffers, self._layers = {}, {}


class StepRecorder:
    """The sinks a :class:`~lightning_hookdiag.hooks.HookSet` writes into.

    Each output or gradient is reduced to the sufficient statistics that the requested statistics need and added to
    a :class:`LayerStatsAggregator`, by the ops of :mod:`lightning_hookdiag.stats` (plus 3 for per-unit activity),
    piece by piece beyond :data:`~lightning_hookdiag.stats.CHUNK_ELEMENTS` elements, with no host read.

    Args:
        aggregator: Where observations are pooled.
        moments: Reduce outputs to activation moments (for ``act_mean``, ``act_std``, ...).
        unit_layers: Indices of layers whose per-unit activity is tracked (``act_dead_frac``).
        unit_dim: Override of the unit axis, see :func:`~lightning_hookdiag.stats.unit_dim_for`.
        names: Layer names, for error messages (``unit_dim`` out of range for a layer's output).
        stack_small: Stack outputs and gradients of at most :data:`SMALL_ELEMENTS` elements and reduce them a stack
            at a time (one copy per tensor instead of 9 or 6 ops); their rows reach the aggregator at
            :meth:`flush`, which the owner calls before the aggregator folds the step.
        components: Their tensor sinks (:attr:`~lightning_hookdiag.components.Component.on_output`, ``on_grad``)
            receive every observed output and gradient after the default statistics.

    Example:
        >>> agg = LayerStatsAggregator(n_layers=1)
        >>> recorder = StepRecorder(agg)
        >>> recorder.on_tensor(0, torch.tensor([1.0, 3.0]))
        >>> agg.update()  # folds the step's rows into the states
        >>> agg.compute()["act_mean"].reshape(-1).tolist()
        [2.0]
    """

    def __init__(
        self,
        aggregator: LayerStatsAggregator,
        moments: bool = True,
        unit_layers: frozenset[int] = frozenset(),
        unit_dim: int | None = None,
        names: list[str] | None = None,
        stack_small: bool = False,
        components: Sequence[Component] = (),
    ) -> None:
        self.aggregator = aggregator
        self._output_sinks = [c.on_output for c in components if c.on_output is not None]
        self._grad_sinks = [c.on_grad for c in components if c.on_grad is not None]
        self._act_stacks = _Stacks(activation_rows, functools.partial(aggregator.rows, "act")) if stack_small else None
        self._grad_stacks = _Stacks(gradient_rows, functools.partial(aggregator.rows, "grad")) if stack_small else None
        self.moments = moments
        self.unit_layers = unit_layers
        aggregator.track_units(unit_layers)
        self.unit_dim = unit_dim
        self.names = names
        self.no_float_output: set[int] = set()
        """Layers whose output held no floating-point tensor (nothing to observe)."""
        self.empty_output: set[int] = set()
        """Layers with a call whose output had no elements (skipped: there is nothing to reduce)."""
        self.sparse_output: set[int] = set()
        """Layers whose output (or its gradient) was a sparse tensor (skipped, like integer outputs)."""
        self.histograms = False
        """Whether outputs and gradients are also binned into histograms (set per step by the callback)."""
        self.workspace = Workspace()
        """Scratch memory of the reductions; the callback releases it at the end of each sampled step."""

    @property
    def stacked(self) -> list[int]:
        """The element capacity of each stack held (bounded by :data:`~lightning_hookdiag.stats.CHUNK_ELEMENTS`)."""
        stacks = [s for s in (self._act_stacks, self._grad_stacks) if s is not None]
        return [b.numel() for s in stacks for b in s._buffers.values()]

    def observe(self, layer: int, tensor: Tensor | None) -> bool:
        """Whether ``tensor`` (a layer's first floating-point output) can be observed; records why not."""
        if tensor is None:
            self.no_float_output.add(layer)
            return False
        if tensor.layout != torch.strided:
            self.sparse_output.add(layer)
            return False
        if not tensor.numel():
            self.empty_output.add(layer)
            return False
        return True

    def on_tensor(self, layer: int, tensor: Tensor | None) -> None:
        """Forward sink: observe the first floating-point tensor of layer ``layer``'s output (``None``: none)."""
        if not self.observe(layer, tensor):
            return
        assert tensor is not None
        agg = self.aggregator
        numel = tensor.numel()
        if self.moments and self._act_stacks is not None and _stackable(tensor):
            self._act_stacks.add(layer, tensor, self.workspace)
        elif self.moments:
            # Piece by piece: the scratch memory stays bounded whatever the tensor's size (one piece, and so one row,
            # for tensors up to CHUNK_ELEMENTS); the pieces' rows pool like calls.
            for piece in chunks(tensor):
                activation_row(piece, agg.rows("act", [layer], piece.numel())[0], self.workspace)
        else:
            agg.rows("count", [layer], numel)
        if layer in self.unit_layers:
            self._check_unit_dim(layer, tensor)
            agg.add(layer, units=unit_maxima(tensor, self.unit_dim))
        if self.histograms:
            agg.pool("act_hist", histogram_counts(tensor, agg.histogram_edges), layer)
        for sink in self._output_sinks:
            sink(layer, tensor)

    def _check_unit_dim(self, layer: int, tensor: Tensor) -> None:
        unit_dim = self.unit_dim
        if unit_dim is not None and tensor.ndim and not -tensor.ndim <= unit_dim < tensor.ndim:
            name = self.names[layer] if self.names else f"#{layer}"
            raise ValueError(
                f"unit_dim: {unit_dim} is out of range for the {tensor.ndim}-D output of {name!r} (shape"
                f" {tuple(tensor.shape)}); expected an axis in [{-tensor.ndim}, {tensor.ndim - 1}] or None"
            )

    def on_grad(self, layer: int, grad: Tensor) -> None:
        """Gradient sink: observe the gradient of the loss w.r.t. the output of layer ``layer``."""
        if grad.layout != torch.strided:
            self.sparse_output.add(layer)
            return
        numel = grad.numel()
        if not numel:
            return
        agg = self.aggregator
        if self._grad_stacks is not None and _stackable(grad):
            self._grad_stacks.add(layer, grad, self.workspace)
        else:
            for piece in chunks(grad):
                gradient_row(piece, agg.rows("grad", [layer], piece.numel())[0], self.workspace)
        if self.histograms:
            agg.pool("grad_hist", histogram_counts(grad, agg.histogram_edges), layer)
        for sink in self._grad_sinks:
            sink(layer, grad)

    def flush(self) -> None:
        """Reduce the stacked small outputs and gradients into the aggregator's call table (``stack_small``)."""
        for stacks in (self._act_stacks, self._grad_stacks):
            if stacks is not None:
                stacks.flush(self.workspace)

    def release(self) -> None:
        """End of a window (logged or discarded): release the scratch memory, forget the outputs not observed."""
        for stacks in (self._act_stacks, self._grad_stacks):
            if stacks is not None:
                stacks.release()
        self.workspace.release()
        self.no_float_output.clear()
        self.empty_output.clear()
        self.sparse_output.clear()
