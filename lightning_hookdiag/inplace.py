"""What a replayed ``training_step`` writes in place into the module: saved before the write, put back after.

BYOL, MoCo and mean-teacher models update a target network in place inside ``training_step`` (under ``no_grad``); a
replay that ran it again would apply that update twice. While a replay runs, :class:`InPlaceGuard` watches every ATen
op (a dispatch mode, below autograd, so ``out=`` arguments and ops called from C++ count too) and copies a tensor of
the module (a parameter, a buffer, a parameter's gradient, a plain tensor attribute of any submodule) before the first
op that writes into its storage. At most ``budget`` bytes are copied: a write that would need more is refused before it
happens (:class:`ReplayWriteLimit`), and what was saved is put back. Afterwards the guard also puts back every tensor
that was rebound (``self.ema = ...``), resized or re-pointed (``.set_``, ``.data = ...``).

Only tensors reachable from the module's attributes are watched: a tensor held in a list, a closure or the optimizer
is not, nor are Python numbers. A write no op reported (a kernel that bypasses the dispatcher) still bumps the
tensor's version counter where autograd counts it; the guard names such a tensor, since it could not put it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hookdiag.names import logged_name
from lightning_hookdiag.table import format_bytes
from lightning_hookdiag.torch_internals import DispatchMode, version, written_tensors

__all__ = ["REPLAY_SAVE_BYTES", "InPlaceGuard", "ReplayWriteLimit"]

REPLAY_SAVE_BYTES = 64 * 2**20
"""The most bytes of the module's tensors a replay copies before writing into them (64 MiB).

A target network as large as this is not copied: its step is not replayed, and its trip says why.
"""

_StorageKey = tuple[torch.device, int]


class ReplayWriteLimit(RuntimeError):
    """A replayed ``training_step`` was about to write in place into more of the module's tensors than may be saved."""


@dataclass(frozen=True)
class _Held:
    """One tensor of the module as the replay found it: where it is bound, its storage and its view of it."""

    name: str
    tensor: Tensor
    storage: torch.UntypedStorage | None  # None: no storage to save (sparse, nested, meta)
    key: _StorageKey | None
    geometry: tuple[int, tuple[int, ...], tuple[int, ...]]  # storage offset, size, stride
    version: int | None  # None: not counted (an inference tensor)


def _storage(tensor: Tensor) -> torch.UntypedStorage | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested and wrapper subclasses have none to copy
        return None
    return storage if storage.data_ptr() != 0 else None  # empty or meta: nothing to save


def _key(storage: torch.UntypedStorage) -> _StorageKey:
    return storage.device, storage.data_ptr()


def _bindings(root: nn.Module) -> Iterator[tuple[dict[str, Any], str, str, Tensor]]:
    """``(container, key, name, tensor)`` for every tensor bound to a module of ``root``.

    Parameters, buffers and plain tensor attributes (a torchmetrics state, an EMA copy kept outside
    ``register_buffer``).
    """
    for path, module in root.named_modules(remove_duplicate=False):
        prefix = f"{logged_name(path, root)}." if path else ""
        containers = (module._parameters, module._buffers, module.__dict__)
        for container in containers:
            for key, value in container.items():
                if isinstance(value, Tensor):
                    yield container, key, prefix + key, value


class InPlaceGuard(DispatchMode):
    """Copy the tensors of ``root`` before a replay's first in-place write into each; put everything back on exit.

    Use as a context manager around the replay, then call :meth:`restore` (also when the replay raised).

    Args:
        root: The module whose tensors must come out of the replay as they went in.
        budget: The most bytes copied; a write that needs more raises :class:`ReplayWriteLimit` before it happens.

    Example:
        >>> student, teacher = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> net = nn.ModuleDict({"student": student, "teacher": teacher})
        >>> before = teacher.weight.detach().clone()
        >>> guard = InPlaceGuard(net)
        >>> with guard, torch.no_grad():
        ...     _ = teacher.weight.mul_(0.9).add_(student.weight, alpha=0.1)  # an EMA step
        >>> guard.saved_bytes, guard.restore(), torch.equal(teacher.weight, before)
        (16, [], True)
        >>> small = InPlaceGuard(net, budget=8)
        >>> with small, torch.no_grad():
        ...     _ = teacher.weight.mul_(0.9)
        Traceback (most recent call last):
        ...
        lightning_hookdiag.inplace.ReplayWriteLimit: training_step writes in place into teacher.weight, ...
    """

    def __init__(self, root: nn.Module, budget: int = REPLAY_SAVE_BYTES) -> None:
        super().__init__()
        self.budget = budget
        self.saved_bytes = 0
        """Bytes copied so far."""
        self._bound = list(_bindings(root))
        self._grads = [(p, p.grad) for p in root.parameters() if p.grad is not None]
        held: dict[int, _Held] = {}
        for _, _, name, tensor in self._bound:
            held.setdefault(id(tensor), self._hold(name, tensor))
        for p, grad in self._grads:
            held.setdefault(id(grad), self._hold(f"{held[id(p)].name}.grad", grad))
        self._held = list(held.values())
        self._watched: dict[_StorageKey, tuple[str, torch.UntypedStorage]] = {}
        for h in self._held:
            if h.storage is not None and h.key is not None:
                self._watched.setdefault(h.key, (h.name, h.storage))
        self._saved: dict[_StorageKey, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    @staticmethod
    def _hold(name: str, tensor: Tensor) -> _Held:
        storage = _storage(tensor)
        geometry = (tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()))
        counted = None if tensor.is_inference() else version(tensor)
        return _Held(name, tensor, storage, None if storage is None else _key(storage), geometry, counted)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for tensor in written_tensors(func, args, kwargs):
            self._save(tensor)
        return func(*args, **kwargs)

    def _save(self, tensor: Tensor) -> None:
        storage = _storage(tensor)
        if storage is None:
            return
        key = _key(storage)
        if key not in self._watched or key in self._saved:
            return
        name, original = self._watched[key]
        size = original.nbytes()
        if self.saved_bytes + size > self.budget:
            raise ReplayWriteLimit(
                f"training_step writes in place into {name}, which would bring the copies a replay keeps to undo its"
                f" writes to {format_bytes(self.saved_bytes + size)}, over the limit of {format_bytes(self.budget)}"
                " (lightning_hookdiag.inplace.REPLAY_SAVE_BYTES)"
            )
        self._saved[key] = (original, original.clone())
        self.saved_bytes += size

    def restore(self) -> list[str]:
        """Put every tensor back: contents, bindings, views; returns the names of those written but not restorable.

        Not restorable: a tensor whose version counter moved although no op reported a write into its storage.
        """
        missed = [
            h.name
            for h in self._held
            if h.version is not None and version(h.tensor) != h.version and h.key not in self._saved
        ]
        for original, copy in self._saved.values():
            if original.nbytes() != copy.nbytes():  # resized in place
                original.resize_(copy.nbytes())
            original.copy_(copy)
        self._saved.clear()
        for container, key, _, tensor in self._bound:
            if container.get(key) is not tensor:  # rebound: self.ema = self.ema * m + ...
                container[key] = tensor
        for p, grad in self._grads:
            if p.grad is not grad:
                p.grad = grad
        with torch.no_grad():
            for h in self._held:
                self._reseat(h)
        return missed

    @staticmethod
    def _reseat(held: _Held) -> None:
        """Point ``held``'s tensor at its storage with its geometry again (after ``resize_``, ``set_``, ``.data =``)."""
        tensor, storage = held.tensor, held.storage
        if storage is None:
            return
        now = (tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()))
        if now != held.geometry or tensor.untyped_storage().data_ptr() != storage.data_ptr():
            offset, size, stride = held.geometry
            tensor.set_(storage, offset, size, stride)
