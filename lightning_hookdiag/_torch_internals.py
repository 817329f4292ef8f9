"""The one place that uses torch internals: every private name the package reads, and why no public API serves.

* :func:`in_backward`: ``torch._C._current_graph_task_id`` tells whether autograd runs a backward on this thread
  (forwards re-run there by activation checkpointing must not be counted twice).
* :func:`calling_modules`: which modules' ``__call__`` are on the Python stack (``sys._getframe``, and the code
  objects of ``nn.Module._call_impl`` / ``_wrapped_call_impl``): a torch-function mode or a global hook sees a call,
  not the module that made it.
* :func:`exit_mode`: leave a torch-function mode that is not on top of the mode stack
  (``torch.overrides._get_current_function_mode_stack``, ``torch._C._pop_torch_function_stack``,
  ``torch._C._push_on_torch_function_stack``): another mode entered after ours may still be active.
* :data:`LOSS_BASE`, :data:`MODE_DEPENDENT`, :data:`DROPOUT_BASE`: ``nn.modules.loss._Loss``, ``batchnorm._BatchNorm``
  and ``dropout._DropoutNd``, the bases of every loss, BatchNorm and Dropout: the public classes miss a user's or a
  library's subclass of a base (a custom loss, apex's ``SyncBatchNorm``). Read at import: a torch that moved one
  fails there, by name, rather than misclassifying modules.

* :data:`DispatchMode`, :func:`written_tensors`, :func:`version`: ``torch.utils._python_dispatch.TorchDispatchMode``,
  an op's ``_schema`` and a tensor's ``_version``: a replay saves what ``training_step`` writes in place before it
  writes (:mod:`lightning_hookdiag._inplace`), which only the dispatcher sees (a torch-function mode misses the writes
  of ``out=`` arguments and of ops called from C++), and the version counter is the witness of a write it missed.

* :func:`in_dispatch_mode`, :func:`function_modes`, :func:`left_modes`: whether a ``TorchDispatchMode`` or a
  ``TorchFunctionMode`` is active (``torch.utils._python_dispatch.any_torch_dispatch_mode_on_stack``, what dynamo
  reads to run a compiled function eagerly: the stack, not the flag ``is_in_torch_dispatch_mode`` that a mode sets
  on entry and that stays set while it is left;
  ``torch.overrides._get_current_function_mode_stack``), and leaving the package's own for one call
  (``torch.utils._python_dispatch._get_current_dispatch_mode_stack``, ``_pop_mode``, ``_push_mode``, and for
  function modes the stack calls of :func:`exit_mode`): no public API lists the active modes, and a compiled
  function runs eagerly under a dispatch mode and compiles again under a function mode (dynamo guards on the mode
  stack), so the one-pass reduction (:mod:`lightning_hookdiag._onepass`) must know, and leave the attention probe
  and the in-place guard for its call.
* :func:`recompile_limit_error`: ``torch._dynamo.exc.FailOnRecompileLimitHit``, what a compiled function with
  ``fail_on_recompile_limit_hit`` raises at dynamo's recompile limit; no public exception names it. Imported on first
  use (``torch._dynamo`` takes ~2 s to import).

:func:`check` lists those of :data:`CHECKED` that this torch lacks (``tests/unit/test_fast_path.py`` runs it);
``tests/unit/test_precursor_probes.py`` checks that each exists, so that a torch release that moves one fails loudly
there, naming it, instead of silently mis-attributing calls.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "DROPOUT_BASE",
    "LOSS_BASE",
    "MODE_DEPENDENT",
    "DispatchMode",
    "CHECKED",
    "calling_modules",
    "check",
    "exit_mode",
    "function_modes",
    "in_backward",
    "in_dispatch_mode",
    "left_modes",
    "recompile_limit_error",
    "version",
    "written_tensors",
]

DispatchMode = TorchDispatchMode
"""The base of a mode that sees every ATen op, below autograd (``__torch_dispatch__``)."""


# Without failing at import (a torch that lacks one fails in the tests, by name).
_CALL_CODES = frozenset(
    code
    for name in ("_call_impl", "_wrapped_call_impl")
    if (code := getattr(getattr(nn.Module, name, None), "__code__", None))
)
LOSS_BASE: type[nn.Module] = nn.modules.loss._Loss
DROPOUT_BASE: type[nn.modules.dropout._DropoutNd] = nn.modules.dropout._DropoutNd
MODE_DEPENDENT: tuple[type, ...] = (nn.modules.batchnorm._BatchNorm, DROPOUT_BASE)
"""The modules whose output depends on the training mode."""


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def calling_modules(depth: int) -> Iterator[Any]:
    """The ``self`` of every ``Module.__call__`` frame on the stack, innermost first, from ``depth`` frames up."""
    frame: FrameType | None = sys._getframe(depth + 1)
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            yield frame.f_locals.get("self")
        frame = frame.f_back


def exit_mode(mode: TorchFunctionMode) -> None:
    """Leave ``mode``, also when modes entered after it are still above it on the stack."""
    stack = torch.overrides._get_current_function_mode_stack()
    if mode not in stack:
        return
    above: list[Any] = []
    while stack and stack[-1] is not mode:
        above.append(torch._C._pop_torch_function_stack())
        stack = torch.overrides._get_current_function_mode_stack()
    mode.__exit__(None, None, None)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


@functools.cache
def _writes(func: Any) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """``func``'s argument names, those its schema marks written, and whether it updates running statistics."""
    schema = func._schema
    names = tuple(a.name for a in schema.arguments)
    marked = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    statistics = "running_mean" in names and "backward" not in schema.name and "no_training" not in schema.name
    return names, marked, statistics


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors the ATen op ``func`` writes in place when called with ``args`` and ``kwargs``.

    The arguments its schema marks ``Tensor(a!)`` (``add_``'s ``self``, an ``out=``, every list of ``_foreach_add_``),
    and the running statistics of a batch norm in training, which ``native_batch_norm``, ``cudnn_batch_norm`` and
    SyncBatchNorm's ``batch_norm_gather_stats_with_counts`` update without their schemas saying so.
    """
    names, marked, statistics = _writes(func)  # read once per op: most ops write nothing and cost a cache hit
    if not marked and not statistics:
        return []
    named = dict(zip(names, args, strict=False))
    named.update(kwargs)
    written = [named.get(name) for name in marked]
    if statistics and named.get("training", True) is True:  # no training argument: an op only training calls
        written += [named.get("running_mean"), named.get("running_var")]
    found: list[torch.Tensor] = []
    for value in written:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: how many in-place writes autograd has counted on it (and its views)."""
    return tensor._version


def in_dispatch_mode() -> bool:
    """Whether a ``TorchDispatchMode`` on this thread's stack would make dynamo run a compiled function eagerly."""
    return bool(_python_dispatch.any_torch_dispatch_mode_on_stack())


def function_modes() -> list[Any]:
    """The active torch-function modes, innermost last."""
    modes: list[Any] = torch.overrides._get_current_function_mode_stack()
    return modes


@contextlib.contextmanager
def left_modes(own: Callable[[Any], bool]) -> Iterator[None]:
    """Leave the modes on top of both mode stacks that ``own`` claims, for the block; they are entered again after.

    Only from the top: a mode entered after ours (a user's ``FlopCounterMode`` inside the step) stays, and so does
    every mode below it, so the block still sees that a mode is active.
    """
    functions: list[Any] = []
    while function_modes() and own(function_modes()[-1]):
        functions.append(torch._C._pop_torch_function_stack())
    dispatches: list[Any] = []
    while True:
        stack = _python_dispatch._get_current_dispatch_mode_stack()
        if not stack or not own(stack[-1]):
            break
        dispatches.append(_python_dispatch._pop_mode())
    try:
        yield
    finally:
        for mode in reversed(dispatches):
            _python_dispatch._push_mode(mode)
        for mode in reversed(functions):
            torch._C._push_on_torch_function_stack(mode)


def recompile_limit_error() -> type[Exception]:
    """The exception a compiled function raises at dynamo's recompile limit (``fail_on_recompile_limit_hit``)."""
    import torch._dynamo.exc  # noqa: PLC0415 - ~2 s; only a process that compiles pays it

    error: type[Exception] = torch._dynamo.exc.FailOnRecompileLimitHit
    return error


CHECKED = (
    "torch.utils._python_dispatch.any_torch_dispatch_mode_on_stack",
    "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
    "torch.utils._python_dispatch._pop_mode",
    "torch.utils._python_dispatch._push_mode",
    "torch._dynamo.exc.FailOnRecompileLimitHit",
)
"""The internals of the fast path's modes and compile errors, by their dotted paths (:func:`check`)."""


def check() -> list[str]:
    """The names of :data:`CHECKED` this torch lacks (imports ``torch._dynamo``): empty when all are there."""
    import importlib  # noqa: PLC0415

    missing = []
    for path in CHECKED:
        module_name, _, name = path.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            found = None
        if found is None:
            missing.append(path)
    return missing
