"""Saved-activation memory per layer: the bytes autograd keeps for backward, by the module that saved them.

While attached, :class:`SavedMemoryTracker` keeps a stack of the selected modules that are running (a forward
pre-hook pushes, a forward hook pops, also when the forward raises) and installs
:class:`torch.autograd.graph.saved_tensors_hooks` whose pack hook adds the size of every tensor autograd saves to the
innermost selected module on the stack, and nothing while the stack is empty.

The pack hook charges each storage once per micro-batch and never a parameter or buffer, and a step's value is its
largest micro-batch's total; what is counted, and why: ``docs/statistics.md#saved-activation-memory-per-layer``.
Non-reentrant checkpointing replaces saved tensors by its own hooks, so nothing reaches ours, and forwards re-run
inside backward are skipped: recomputations are not counted.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> tracker = SavedMemoryTracker(dict(net.named_children()), net)
    >>> tracker.attach()
    >>> net(torch.zeros(2, 4)).sum().backward()
    >>> tracker.remove()
    >>> tracker.take()  # input of 0 (2x4 floats), output of 1 (2x8 floats), nothing new for 2
    [32, 64, 0]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hookdiag.hooks import in_backward

__all__ = ["SavedMemoryTracker"]


class SavedMemoryTracker:
    """Bytes saved for backward per selected module, between :meth:`attach` and :meth:`remove`.

    A :class:`~lightning_hookdiag.hooks.Companion` of the callback's hook set, which attaches and removes it with
    its own hooks, once per sampled micro-batch.

    Args:
        modules: Ordered ``{name: module}``; :meth:`take` lists bytes in this order.
        root: The model whose parameters and buffers are never counted.
    """

    def __init__(self, modules: Mapping[str, nn.Module], root: nn.Module) -> None:
        self.modules: list[nn.Module] = list(modules.values())
        self.root = root
        self.bytes: list[int] = [0] * len(self.modules)
        """Bytes saved per module since the last :meth:`take`."""
        self.peak: list[int] = [0] * len(self.modules)
        """Per module, the most bytes any one micro-batch saved since the last :meth:`pop_peak`."""
        self._stack: list[int] = []
        self._seen: set[tuple[Any, int]] = set()
        self._own: set[tuple[Any, int]] = set()
        self._handles: list[RemovableHandle] = []
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None

    @property
    def attached(self) -> bool:
        """Whether the module hooks and the saved-tensor hooks are installed."""
        return self._context is not None

    def attach(self) -> None:
        """Install the hooks (no-op if attached); the saved-tensor hooks stay active until :meth:`remove`."""
        if self._context is not None:
            return
        self._own = {_storage_key(t)[0] for t in (*self.root.parameters(), *self.root.buffers())}
        self._stack = []
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(self._make_push(i)))
            self._handles.append(module.register_forward_hook(self._make_pop(i), always_call=True))
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._context.__enter__()

    def remove(self) -> None:
        """Remove every hook; safe to call any number of times."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)
        self._stack = []
        self._own = set()

    def take(self) -> list[int]:
        """The bytes saved per module since the last call (one micro-batch), and start counting afresh."""
        out, self.bytes = self.bytes, [0] * len(self.modules)
        self._seen = set()
        return out

    def end_micro_batch(self) -> None:
        """Fold the current micro-batch into :attr:`peak` (host-side: no device copy per micro-batch)."""
        self.peak = [max(a, b) for a, b in zip(self.peak, self.take(), strict=True)]

    def drop_micro_batch(self) -> None:
        """Forget the current micro-batch's bytes (it was interrupted: a partial count is not a measurement)."""
        self.take()

    def pop_peak(self) -> list[int]:
        """:attr:`peak` (the step's largest micro-batch per module), and start the next step afresh."""
        out, self.peak = self.peak, [0] * len(self.modules)
        return out

    def _make_push(self, index: int) -> Any:
        def push(module: nn.Module, args: Any) -> None:
            if not in_backward():
                self._stack.append(index)

        return push

    def _make_pop(self, index: int) -> Any:
        def pop(module: nn.Module, args: Any, output: Any) -> None:
            if not in_backward() and self._stack and self._stack[-1] == index:
                self._stack.pop()

        return pop

    def _pack(self, tensor: Tensor) -> Tensor:
        if self._stack and not in_backward():
            key, nbytes = _storage_key(tensor)
            if key not in self._seen and key not in self._own:
                self._seen.add(key)
                self.bytes[self._stack[-1]] += nbytes
        return tensor


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


def _storage_key(tensor: Tensor) -> tuple[tuple[Any, int], int]:
    """``((device, storage address), storage bytes)``; tensors without a plain storage count their own bytes."""
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # e.g. sparse or wrapper tensors: no shared storage to dedupe
        return (tensor.device, id(tensor)), tensor.nelement() * tensor.element_size()
