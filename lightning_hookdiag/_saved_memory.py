"""Saved-activation memory per layer: the bytes autograd keeps for backward, by the selected module that saved them.

A forward pre-hook and an always-called forward hook keep a stack of the running selected modules; the pack hook of
``saved_tensors_hooks`` charges each storage to the innermost one. Forwards re-run inside backward are skipped, and
non-reentrant checkpointing saves through its own hooks. What counts (storages once, never a parameter or buffer),
and why: ``docs/statistics.md#saved-activation-memory-per-layer``; hand-derived examples:
``tests/unit/test_saved_memory.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_hookdiag._aggregation import LayerStatsAggregator, host_values
from lightning_hookdiag._torch_internals import in_backward
from lightning_hookdiag.components import Component, Setup, WindowStart, component, module_hook

__all__ = ["SavedMemoryTracker", "saved_bytes"]


class SavedMemoryTracker(Component):
    """Bytes saved for backward per module while attached.

    Args:
        modules: Ordered ``{name: module}``; :attr:`peak` lists bytes in this order.
        root: The model whose parameters and buffers are never counted.
        aggregator: Where the step's peak is pooled (the max state ``act_saved``).
    """

    def __init__(self, modules: Mapping[str, nn.Module], root: nn.Module, aggregator: LayerStatsAggregator) -> None:
        self.modules: list[nn.Module] = list(modules.values())
        self.root = root
        self._aggregator = aggregator
        aggregator.add_state("act_saved", aggregator.new_state(len(self.modules)), "max")
        self.bytes: list[int] = [0] * len(self.modules)
        """Bytes saved per module in the current micro-batch."""
        self.peak: list[int] = [0] * len(self.modules)
        """Per module, the most bytes any one micro-batch of the window saved."""
        self._stack: list[int] = []
        self._seen: set[tuple[Any, int]] = set()
        self._own: set[tuple[Any, int]] = set()

    @override
    def attach(self) -> None:
        if self.attached:
            return
        self._own = {_storage_key(t)[0] for t in (*self.root.parameters(), *self.root.buffers())}
        exits = self.hold()
        for i, module in enumerate(self.modules):
            exits.enter_context(module.register_forward_pre_hook(module_hook(self._push, i)))
            exits.enter_context(module.register_forward_hook(module_hook(self._pop, i), always_call=True))
        exits.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor))

    @override
    def remove(self) -> None:
        super().remove()
        self._stack, self._own = [], set()
        self._take()  # a partial count is not a measurement

    def _take(self) -> list[int]:
        out, self.bytes = self.bytes, [0] * len(self.modules)
        self._seen = set()
        return out

    @override
    def end_micro_batch(self) -> None:  # host-side: no device copy per micro-batch
        self.peak = [max(a, b) for a, b in zip(self.peak, self._take(), strict=True)]

    @override
    def reset(self, window: WindowStart) -> None:
        self.peak = [0] * len(self.modules)

    @override
    def fold(self) -> None:  # the step's one copy to the device
        agg = self._aggregator
        agg.pool("act_saved", host_values(self.peak, agg.acc_dtype, agg.act_moments.device))

    @override
    def finalize(self, pooled: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {"act_saved_bytes": pooled["act_saved"]}

    def _push(self, index: int, module: nn.Module, args: Any) -> None:
        if not in_backward():
            self._stack.append(index)

    def _pop(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not in_backward() and self._stack and self._stack[-1] == index:
            self._stack.pop()

    def _pack(self, tensor: Tensor) -> Tensor:
        if self._stack and not in_backward():
            key, nbytes = _storage_key(tensor)
            if key not in self._seen and key not in self._own:
                self._seen.add(key)
                self.bytes[self._stack[-1]] += nbytes
        return tensor


@component
def saved_bytes(setup: Setup) -> SavedMemoryTracker | None:
    """The fit's :class:`SavedMemoryTracker`, when ``act_saved_bytes`` is in ``stats=``."""
    wanted = "act_saved_bytes" in setup.config.stats
    return SavedMemoryTracker(setup.modules, setup.model, setup.aggregator) if wanted else None


def _storage_key(tensor: Tensor) -> tuple[tuple[Any, int], int]:
    """``((device, storage address), storage bytes)``; tensors without a plain storage count their own bytes."""
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # e.g. sparse or wrapper tensors: no shared storage to dedupe
        return (tensor.device, id(tensor)), tensor.nelement() * tensor.element_size()
