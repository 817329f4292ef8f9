"""Test instruments that see what the package's own code does during a fit, apart from what the model does.

:func:`package_code` wraps every entry point through which the package's code runs inside a training step: the
callback's Lightning methods, and every hook function defined in the package that is registered while the fit runs
(module forward and pre-forward hooks, tensor hooks on outputs, global module hooks, saved-tensor hooks, optimizer
step hooks) plus the attention probe's observation. Each call runs inside ``scope(kind)``, a context manager the
instrument chooses: ``kind`` is ``"hook:output"`` for module forward hooks (which observe outputs), ``"hook:grad"``
for tensor hooks (output gradients), ``"hook:attention"`` for the attention probe, ``"hook:other"`` for any other
hook (all of them per layer and micro-batch), ``"micro_batch"`` for the
callback's Lightning methods that run once per micro-batch (:data:`MICRO_BATCH_METHODS`) and ``"callback"`` for its
other Lightning methods.

Two instruments use it:

* :class:`ScratchMeter`: the peak of the bytes the package's code has allocated and not yet freed, read from the
  allocator itself through ``torch.profiler`` memory events (which also see the temporaries inside one aten op,
  e.g. the float64 copy ``_foreach_norm(dtype=float64)`` makes of each parameter), attributed to the package when
  they happen inside one of its scopes (a ``record_function`` range);
* :class:`HostDataWatch`: every creation of a tensor from host data (``torch.tensor``, ``as_tensor``, ...) and every
  copy of a tensor the package created on the host to a device, with the package line that did it. On an
  accelerator each of these is a host-to-device copy, which synchronises with the stream; on the CPU it shows as
  the same calls, so a CPU-only machine can test for them.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

import lightning_hookdiag

PACKAGE_DIR = str(Path(lightning_hookdiag.__file__).resolve().parent)
Scope = Callable[[str], contextlib.AbstractContextManager]
MICRO_BATCH_METHODS = ("on_before_backward", "on_after_backward")
"""The callback's Lightning methods that run once per micro-batch and do no per-step work."""


def _is_package_code(fn: Any) -> bool:
    fn = getattr(fn, "__func__", fn)
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is not None:
        return str(Path(code.co_filename).resolve()).startswith(PACKAGE_DIR)
    return type(fn).__module__.startswith("lightning_hookdiag")  # a callable object of the package


def _scoped(fn: Callable[..., Any], scope: Scope, kind: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with scope(kind):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def package_code(callback: Any, scope: Scope) -> Iterator[None]:
    """Run every call of the package's code during the block inside ``scope(kind)`` (see the module docstring).

    Args:
        callback: The ``LayerHealthCallback`` whose Lightning methods are wrapped (on the instance only).
        scope: ``scope("hook")`` or ``scope("callback")`` returns the context manager a call runs in.
    """
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        patches.append((owner, name, owner.__dict__[name] if name in vars(owner) else None))
        setattr(owner, name, value)

    def wrap_registration(owner: Any, name: str, position: int, kind: str) -> None:
        original = getattr(owner, name)

        def register(*args: Any, **kwargs: Any) -> Any:
            args = list(args)
            if len(args) > position and _is_package_code(args[position]):
                hook = args[position]
                # The output-logit probe's forward hooks (one per output-layer candidate) are not the statistics'
                # hooks: counted apart, so that "per observed output" stays the cost of one observation.
                bound = hook.func if isinstance(hook, functools.partial) else getattr(hook, "__wrapped__", hook)
                probe = "PrecursorProbes._output_hook" in getattr(getattr(bound, "__code__", None), "co_qualname", "")
                args[position] = _scoped(hook, scope, "hook:probe" if probe and kind == "hook:output" else kind)
            return original(*args, **kwargs)

        patch(owner, name, register)

    # Methods: the hook is the second positional argument (after self); module-level functions: the first.
    wrap_registration(nn.Module, "register_forward_hook", 1, "hook:output")
    wrap_registration(nn.Module, "register_forward_pre_hook", 1, "hook:other")
    wrap_registration(nn.Module, "register_full_backward_hook", 1, "hook:other")
    wrap_registration(Tensor, "register_hook", 1, "hook:grad")
    wrap_registration(torch.optim.Optimizer, "register_step_post_hook", 1, "hook:other")
    wrap_registration(torch.optim.Optimizer, "register_step_pre_hook", 1, "hook:other")
    wrap_registration(torch.nn.modules.module, "register_module_forward_hook", 0, "hook:other")
    saved_init = torch.autograd.graph.saved_tensors_hooks.__init__

    def saved_hooks_init(self: Any, pack: Any, unpack: Any) -> None:
        if _is_package_code(pack):
            pack, unpack = _scoped(pack, scope, "hook:other"), _scoped(unpack, scope, "hook:other")
        saved_init(self, pack, unpack)

    patch(torch.autograd.graph.saved_tensors_hooks, "__init__", saved_hooks_init)
    from lightning_hookdiag import _precursor_probes as attention

    probe = getattr(attention, "AttentionProbe", None)
    if probe is not None and hasattr(probe, "_observe"):
        patch(probe, "_observe", _scoped(probe._observe, scope, "hook:attention"))
    wrapped_methods = []
    for name in dir(type(callback)):
        if name.startswith("on_") or name in ("setup", "teardown"):
            method = getattr(callback, name)
            if callable(method) and _is_package_code(method):
                kind = "micro_batch" if name in MICRO_BATCH_METHODS else "callback"
                setattr(callback, name, _scoped(method, scope, kind))
                wrapped_methods.append(name)
    try:
        yield
    finally:
        for owner, name, original in reversed(patches):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        for name in wrapped_methods:
            delattr(callback, name)


# ------------------------------------------------------------------------------------------------ scratch meter
class ScratchMeter:
    """Peak bytes allocated by the package's code and live at once, from the allocator's own events.

    Use :meth:`scope` as the ``scope`` of :func:`package_code` and run the fit inside :meth:`profiling`. Every
    allocation made while a package scope is open (at any depth of the aten call tree below it, on any thread) is
    the package's until it is freed, wherever the free happens. Memory the package keeps alive without allocating it
    (a reference to a model output) is not counted: the model allocated it.

    Example:
        >>> meter = ScratchMeter()
        >>> x = torch.ones(1 << 20)
        >>> with meter.profiling():
        ...     with meter.scope("hook"):
        ...         y = x.double().sum()  # an 8 MiB float64 copy, freed at once
        ...     z = x * 2  # not the package's
        >>> meter.peak_bytes >= 8 << 20, meter.peak_bytes < 9 << 20
        (True, True)
    """

    LABEL = "hookdiag_package_code"

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.allocations = 0
        self.largest = 0

    def scope(self, kind: str) -> contextlib.AbstractContextManager:
        """A profiler range that marks package code."""
        return torch.autograd.profiler.record_function(f"{self.LABEL}:{kind}")

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Record the allocator's events during the block; :attr:`peak_bytes` is set when it ends."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities, profile_memory=True) as prof:
            yield
        self._measure(prof.profiler.kineto_results.experimental_event_tree())

    def _measure(self, roots: list[Any]) -> None:
        from torch._C._profiler import _EventType

        events: list[tuple[int, int, int, bool]] = []  # (time, ptr, bytes, inside a package scope)
        stack = [(node, False) for node in roots]
        while stack:
            node, inside = stack.pop()
            if node.typed[0] == _EventType.Allocation:
                fields = node.extra_fields
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size, inside))
                continue
            inside = inside or node.name.startswith(self.LABEL)
            stack.extend((child, inside) for child in node.children)
        live: dict[int, int] = {}
        current = peak = 0
        for _, ptr, size, inside in sorted(events, key=lambda e: e[0]):
            if size > 0 and inside:
                live[ptr] = size
                current += size
                peak = max(peak, current)
                self.allocations += 1
                self.largest = max(self.largest, size)
            elif size < 0 and ptr in live:
                current -= live.pop(ptr)
        self.peak_bytes = peak


# ---------------------------------------------------------------------------------------------- host data watch
_FROM_HOST_DATA = frozenset(
    f for f in (torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, Tensor.new_tensor) if f is not None
)
"""Calls that build a tensor from host data: with a device argument, a host-to-device copy on an accelerator."""
_FACTORIES = frozenset(
    getattr(torch, n)
    for n in ("full", "zeros", "ones", "empty", "arange", "linspace", "logspace", "eye", "rand", "randn", "randint")
)
"""Calls that make a tensor on the host when no ``device`` is given."""
_MOVES = frozenset((Tensor.to, Tensor.cuda, Tensor.copy_, Tensor.__setitem__))


@dataclass(frozen=True)
class HostCopy:
    """One creation of a tensor from host data, or one copy of a host-made tensor to a device, by the package."""

    what: str
    """``"from host data"`` or ``"host tensor to device"``."""
    call: str
    kind: str
    """The scope it happened in: ``"hook"``, ``"micro_batch"`` or ``"callback"``."""
    where: str
    """``path:line (function)`` of the innermost package frame."""
    step: int


def _package_frame() -> str:
    # The attention probe is a mode that sees the package's own calls too: its pass-through is not where they are.
    for frame in reversed(traceback.extract_stack()):
        if frame.name != "__torch_function__" and str(Path(frame.filename).resolve()).startswith(PACKAGE_DIR):
            return f"lightning_hookdiag/{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "?"


def _names_a_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if "device" in kwargs or "other" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str, Tensor, int)) and not isinstance(a, bool) for a in args)


class HostDataWatch(TorchFunctionMode):
    """Records the package's host-to-device copies (see the module docstring), per step and scope.

    Enter it around the fit (``with watch:``) and use :meth:`scope` as the ``scope`` of :func:`package_code`.
    Tensors the package makes on the host (a factory call without ``device``, ``torch.tensor`` without one, and
    anything computed from such tensors alone) are remembered; moving one with ``.to(device)``, ``.cuda()`` or
    ``copy_`` into a tensor the model's device holds is a host-to-device copy on an accelerator.
    """

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[HostCopy] = []
        self.step = -1
        self._host_made: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._kinds: list[str] = []

    @contextlib.contextmanager
    def scope(self, kind: str) -> Iterator[None]:
        """Watch while the package's code runs.

        The mode itself stays entered around the whole fit (``with watch:``) instead: the package pushes and pops
        modes of its own (the attention probe) inside its scopes, and a mode entered per scope would pop theirs.
        """
        self._kinds.append(kind)
        try:
            yield
        finally:
            self._kinds.pop()

    def _record(self, what: str, func: Any) -> None:
        kinds = [k.split(":")[0] for k in self._kinds]
        kind = next((k for k in ("hook", "micro_batch") if k in kinds), "callback")
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        self.copies.append(HostCopy(what, name, kind, _package_frame(), self.step))

    def _is_host_made(self, t: Any) -> bool:
        return isinstance(t, Tensor) and t in self._host_made

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self._kinds:  # the model's code, Lightning's
            return func(*args, **kwargs)
        if func in _FROM_HOST_DATA:
            self._record("from host data", func)
        elif func in _MOVES:
            source = {Tensor.copy_: 1, Tensor.__setitem__: 2}.get(func, 0)
            source = args[source] if len(args) > source else None
            copies = func in (Tensor.copy_, Tensor.__setitem__) or _names_a_device(args[1:], kwargs)
            if (
                self._is_host_made(source)
                and source.numel()  # an empty copy moves nothing (no launch, no sync)
                and copies
                and not self._is_host_made(args[0] if func is not Tensor.to else None)
            ):
                self._record("host tensor to device", func)
        out = func(*args, **kwargs)
        if func in (Tensor.to, Tensor.cuda) and isinstance(out, Tensor) and _names_a_device(args[1:], kwargs):
            # Moved: on an accelerator ``out`` is a new tensor on the device, not the host's. On the CPU
            # ``.to("cpu")`` returns the host tensor itself; an alias stands in for the device's copy, so that what
            # the package keeps of it is the device's and the host tensor, moved again later, is still the host's.
            if out is args[0] and self._is_host_made(out):
                out = out.view_as(out)
            return out
        made_here = (func in _FACTORIES or func in _FROM_HOST_DATA) and kwargs.get("device") is None
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        for a in (*args, *kwargs.values()):
            if isinstance(a, (list, tuple)):
                tensors += [t for t in a if isinstance(t, Tensor)]
        derived = bool(tensors) and all(self._is_host_made(t) for t in tensors) and func not in _MOVES
        if (made_here or derived) and isinstance(out, Tensor):
            self._host_made[out] = True
        return out

    def where(self, kinds: tuple[str, ...] = ("hook", "micro_batch", "callback"), after_step: int = -1) -> list[str]:
        """``what: call at where`` of the recorded copies in scopes of ``kinds`` after ``after_step``, sorted."""
        found = {f"{c.what}: {c.call} at {c.where}" for c in self.copies if c.kind in kinds and c.step > after_step}
        return sorted(found)
