"""The sinks a :class:`~lightning_hookdiag.hooks.HookSet` writes into: outputs and gradients to statistics.

Each observed tensor goes once to :func:`~lightning_hookdiag.stats.reduce_tensor`, which writes its rows into the
aggregator's call table and returns the per-unit maxima and histogram counts passed on (the aggregator never sees it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_hookdiag import stats
from lightning_hookdiag.aggregation import LayerStatsAggregator
from lightning_hookdiag.components import Component
from lightning_hookdiag.stats import Workspace, activation_row, gradient_row, reduce_tensor

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


class _Stacks:
    """Small tensors of one kind, copied into stacks of equal size and reduced one stack at a time.

    On a model of many small layers the fixed cost of each reduction op, a kernel launch on an accelerator, is what a
    sampled step pays for. A copy into the next row of a stack is one op; the full stack (or, at the step's end, the
    rows filled) is reduced in the ops of one tensor. Copies, not references: an output can be changed in place
    after its hook ran (``ReLU(inplace=True)``).
    """

    def __init__(self, reduce: Callable[..., Tensor], rows: Callable[[list[int], int], Tensor]) -> None:
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
            if layers := self._layers[key]:
                self._reduce(self._buffers[key][: len(layers)], self._rows(layers, key[1]), workspace, dim=1)
                self._layers[key] = []

    def release(self) -> None:
        self._buffers, self._layers = {}, {}


class StepRecorder:
    """The sinks a :class:`~lightning_hookdiag.hooks.HookSet` writes into, with no host read.

    Args:
        aggregator: Where observations are pooled.
        moments: Reduce outputs to activation moments (for ``act_mean``, ``act_std``, ...).
        unit_layers: Indices of layers whose per-unit activity is tracked (``act_dead_frac``).
        unit_dim: Override of the unit axis, see :func:`~lightning_hookdiag.stats.unit_maxima`.
        names: Layer names, for error messages (``unit_dim`` out of range for a layer's output).
        stack_small: Stack outputs and gradients of at most :data:`SMALL_ELEMENTS` elements and reduce them a stack
            at a time (one copy per tensor instead of 9 or 6 ops); their rows reach the aggregator at :meth:`flush`,
            which the owner calls before the aggregator folds the step.
        components: Their ``on_output`` / ``on_grad`` sinks receive every observed output and gradient after the
            default statistics, while they are attached.
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
        # Only attached components get tensors: those that do not watch replays are not attached during one.
        # Each with its sink, which components set in their constructors.
        self._output_sinks = [(c, c.on_output) for c in components if c.on_output is not None]
        self._grad_sinks = [(c, c.on_grad) for c in components if c.on_grad is not None]
        self._stacks = {
            kind: _Stacks(reduce, functools.partial(aggregator.rows, kind))
            for kind, reduce in (("act", activation_row), ("grad", gradient_row))
            if stack_small
        }
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
        self.nested_output: set[int] = set()
        """Layers whose output (or its gradient) was a nested tensor, strided or jagged layout (skipped)."""
        self.opaque_output: dict[int, str] = {}
        """Layers whose output (or its gradient) held no values to read (meta, ``DTensor``), with what it was."""
        self.histograms = False
        """Whether outputs and gradients are also binned into histograms (set per step by the callback)."""
        self.workspace = Workspace()
        """Scratch memory of the reductions; the callback releases it at the end of each sampled step."""

    def _reduce(self, kind: str, layer: int, tensor: Tensor, units: bool = False) -> None:
        # Rows: stacked small tensors reach the table at the stack's flush, the rest a row per piece here.
        unit_dim = self.unit_dim
        if units and unit_dim is not None and tensor.ndim and not -tensor.ndim <= unit_dim < tensor.ndim:
            name = self.names[layer] if self.names else f"#{layer}"
            raise ValueError(
                f"unit_dim: {unit_dim} is out of range for the {tensor.ndim}-D output of {name!r} (shape"
                f" {tuple(tensor.shape)}); expected an axis in [{-tensor.ndim}, {tensor.ndim - 1}] or None"
            )
        agg = self.aggregator
        stacks = self._stacks.get(kind)
        row = None
        if kind == "act" and not self.moments:
            agg.rows("count", [layer], tensor.numel())
        elif stacks is not None and _stackable(tensor):
            stacks.add(layer, tensor, self.workspace)
        else:
            row = functools.partial(self._row, kind, layer)
        edges = agg.histogram_edges if self.histograms else None
        maxima, hist = reduce_tensor(tensor, row, self.workspace, kind == "grad", units, self.unit_dim, edges)
        if maxima is not None:
            agg.add(layer, units=maxima)
        if hist is not None:
            agg.pool(f"{kind}_hist", hist, layer)

    def _row(self, kind: str, layer: int, numel: int) -> Tensor:
        return self.aggregator.rows(kind, [layer], numel)[0]

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

    def flush(self) -> None:
        """Reduce the stacked small outputs and gradients into the aggregator's call table (``stack_small``)."""
        for stacks in self._stacks.values():
            stacks.flush(self.workspace)

    def release(self) -> None:
        """End of a window (logged or discarded): release the scratch memory, forget the outputs not observed."""
        for stacks in self._stacks.values():
            stacks.release()
        self.workspace.release()
        for skipped in (self.no_float_output, self.empty_output, self.sparse_output, self.nested_output):
            skipped.clear()
        self.opaque_output.clear()
