"""What a replayed ``training_step`` writes in place into the module: copied before the write, put back after.

Why (a mean teacher's EMA update would run twice), what is watched and the bound: ``docs/sentinel.md#the-replay``.
Below autograd, so ``out=`` arguments and ops called from C++ count; the version counter witnesses a write no op
reported, which cannot be put back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hookdiag._names import logged_name
from lightning_hookdiag._table import format_bytes
from lightning_hookdiag._torch_internals import DispatchMode, version, written_tensors

__all__ = ["REPLAY_SAVE_BYTES", "InPlaceGuard", "ReplayWriteLimit"]

REPLAY_SAVE_BYTES = 64 * 2**20
"""The most bytes of the module's tensors a replay copies before writing into them (64 MiB)."""

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
    # storage offset, size, stride; torch types the offset int | SymInt (a SymInt only while tracing symbolically)
    geometry: tuple[int | torch.SymInt, tuple[int, ...], tuple[int, ...]]
    version: int | None  # None: not counted (an inference tensor)

    @classmethod
    def of(cls, name: str, tensor: Tensor) -> _Held:
        storage, key = _storage(tensor) or (None, None)
        geometry = (tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()))
        return cls(name, tensor, storage, key, geometry, None if tensor.is_inference() else version(tensor))

    def reseat(self) -> None:
        """Point the tensor at its storage with its geometry again (after ``resize_``, ``set_``, ``.data =``)."""
        now = (self.tensor.storage_offset(), tuple(self.tensor.size()), tuple(self.tensor.stride()))
        moved = self.storage is not None and self.tensor.untyped_storage().data_ptr() != self.storage.data_ptr()
        if self.storage is not None and (moved or now != self.geometry):
            self.tensor.set_(self.storage, *self.geometry)


def _storage(tensor: Tensor) -> tuple[torch.UntypedStorage, _StorageKey] | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested and wrapper subclasses have none to copy
        return None
    # Empty or meta: nothing to save.
    return (storage, (storage.device, storage.data_ptr())) if storage.data_ptr() != 0 else None


def _bindings(root: nn.Module) -> Iterator[tuple[dict[str, Any], str, str, Tensor]]:
    """``(container, key, name, tensor)`` for every parameter, buffer and plain tensor attribute of ``root``."""
    for path, module in root.named_modules(remove_duplicate=False):
        prefix = f"{logged_name(path, root)}." if path else ""
        for container in (module._parameters, module._buffers, module.__dict__):
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
        lightning_hookdiag._inplace.ReplayWriteLimit: training_step writes in place into teacher.weight, ...
    """

    def __init__(self, root: nn.Module, budget: int = REPLAY_SAVE_BYTES) -> None:
        # TorchDispatchMode.__init__ is unannotated; pyproject's untyped_calls_exclude = ["torch"] covers calls by
        # name, but mypy resolves no name for a call through super(), so it still reports this one.
        super().__init__()  # type: ignore[no-untyped-call]
        self.budget = budget
        self.saved_bytes = 0
        """Bytes copied so far."""
        self._bound = list(_bindings(root))
        self._grads = [(p, p.grad) for p in root.parameters() if p.grad is not None]
        held: dict[int, _Held] = {}
        for _, _, name, tensor in self._bound:
            held.setdefault(id(tensor), _Held.of(name, tensor))
        for p, grad in self._grads:
            held.setdefault(id(grad), _Held.of(f"{held[id(p)].name}.grad", grad))
        self._held = list(held.values())
        # The first name bound to each storage: the one a refused write is reported under.
        self._watched: dict[_StorageKey, tuple[str, torch.UntypedStorage]] = {}
        for h in reversed(self._held):
            if h.storage is not None and h.key is not None:
                self._watched[h.key] = (h.name, h.storage)
        self._saved: dict[_StorageKey, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for tensor in written_tensors(func, args, kwargs):
            self._save(tensor)
        return func(*args, **kwargs)

    def _save(self, tensor: Tensor) -> None:
        _, key = _storage(tensor) or (None, None)
        if key not in self._watched or key in self._saved:
            return
        name, original = self._watched[key]
        size = original.nbytes()
        if self.saved_bytes + size > self.budget:
            raise ReplayWriteLimit(
                f"training_step writes in place into {name}, which would bring the copies a replay keeps to undo its"
                f" writes to {format_bytes(self.saved_bytes + size)}, over the limit of {format_bytes(self.budget)}"
                " (lightning_hookdiag._inplace.REPLAY_SAVE_BYTES)"
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
                h.reseat()
        return missed
