"""The sinks a :class:`~lightning_hookdiag.hooks.HookSet` writes into: outputs and gradients to statistics.

:class:`StepRecorder` reduces each observed tensor where it lives (:func:`~lightning_hookdiag.stats.activation_row`,
:func:`~lightning_hookdiag.stats.gradient_row`) into a row of the
:class:`~lightning_hookdiag.aggregation.LayerStatsAggregator`'s call table, which folds them once per step. It holds
no observation itself, and the aggregator does not call back into it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_hookdiag.aggregation import LayerStatsAggregator
from lightning_hookdiag.hooks import first_floating_tensor
from lightning_hookdiag.stats import Workspace, activation_row, chunks, gradient_row, histogram_counts, unit_maxima

__all__ = ["StepRecorder"]


class StepRecorder:
    """The sinks a :class:`~lightning_hookdiag.hooks.HookSet` writes into.

    Each output or gradient is reduced to the sufficient statistics that the requested statistics need and added to
    a :class:`LayerStatsAggregator`, on any device by the same ops: 12 kernel-launching tensor ops per output with
    every default statistic (9 for the moments, 3 for per-unit activity), 6 per gradient, and
    no host read (see :mod:`lightning_hookdiag.stats`). Tensors of more than
    :data:`~lightning_hookdiag.stats.CHUNK_ELEMENTS` elements are reduced piece by piece (9 and 6 ops per piece), so
    the scratch memory is bounded.

    Args:
        aggregator: Where observations are pooled.
        moments: Reduce outputs to activation moments (for ``act_mean``, ``act_std``, ...).
        unit_layers: Indices of layers whose per-unit activity is tracked (``act_dead_frac``).
        unit_dim: Override of the unit axis, see :func:`~lightning_hookdiag.stats.unit_dim_for`.
        names: Layer names, for error messages (``unit_dim`` out of range for a layer's output).

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
    ) -> None:
        self.aggregator = aggregator
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
        if self.moments:
            # Piece by piece: the scratch memory stays bounded whatever the tensor's size (one piece, and so one row,
            # for tensors up to CHUNK_ELEMENTS); the pieces' rows pool like calls.
            for piece in chunks(tensor):
                activation_row(piece, agg.activation_row(layer, piece.numel()), self.workspace)
        else:
            agg.add_count(layer, numel)
        if layer in self.unit_layers:
            self._check_unit_dim(layer, tensor)
            agg.add(layer, units=unit_maxima(tensor, self.unit_dim))
        if self.histograms:
            agg.add(layer, act_hist=histogram_counts(tensor, agg.histogram_edges))

    def on_output(self, layer: int, output: Any) -> None:
        """Forward sink for a raw module output: :meth:`on_tensor` of its first floating-point tensor."""
        self.on_tensor(layer, first_floating_tensor(output))

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
        for piece in chunks(grad):
            gradient_row(piece, agg.gradient_row(layer, piece.numel()), self.workspace)
        if self.histograms:
            agg.add(layer, grad_hist=histogram_counts(grad, agg.histogram_edges))

    def release(self) -> None:
        """End of a window (logged or discarded): release the scratch memory, forget the outputs not observed."""
        self.workspace.release()
        self.no_float_output.clear()
        self.empty_output.clear()
        self.sparse_output.clear()
