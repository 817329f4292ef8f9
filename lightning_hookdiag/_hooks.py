"""The hook lifecycle: forward hooks (and output tensor hooks) on resolved modules, and the removal of every one.

Activation gradients come from a tensor hook registered on the output inside the forward hook: it receives the
gradient w.r.t. the value the module produced, also when an in-place op (``nn.ReLU(inplace=True)``) follows, where the
``BackwardHookFunction`` view of ``register_full_backward_hook`` breaks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hookdiag._torch_internals import in_backward
from lightning_hookdiag.components import call_all

__all__ = ["Companion", "HookSet", "compiled_stance", "first_floating_tensor", "tensors"]


def tensors(value: Any, path: str | None = None) -> Iterator[tuple[str | None, Tensor]]:
    """Every tensor in ``value`` (through tuples, lists, dicts), with its path from ``path`` (``x[0]['k']``) or None."""
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from tensors(item, None if path is None else f"{path}[{i}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from tensors(item, None if path is None else f"{path}[{key!r}]")


def first_floating_tensor(output: Any) -> Tensor | None:
    """The first floating-point tensor in ``output`` (see :func:`tensors`)."""
    if isinstance(output, Tensor):  # the common case, without a generator
        return output if output.is_floating_point() else None
    return next((t for _, t in tensors(output) if t.is_floating_point()), None)


@contextlib.contextmanager
def sink_mode() -> Iterator[None]:
    """What a sink runs under: no grad, and never inference mode.

    A module may run under ``torch.inference_mode()`` in a sampled step (a target computed inside ``training_step``);
    scratch a sink keeps across calls (the recorder's call table) must not become an inference tensor there (reading
    one outside inference mode is allowed).
    """
    # Entered only when needed: inference_mode(False) also resets the forward-AD and multithreading modes.
    leave = torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()
    with leave, torch.no_grad():
        yield


# Dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``), so a compiled graph ignores hooks added later;
# the ``force_eager`` stance runs compiled callables' Python code without touching the compile cache. The stance is
# process-wide, so one count serves every hook set: the first to enter saves it, the last to leave restores it, in
# whatever order callbacks and ``capture_activations`` blocks remove their hooks.
_stance_lock = threading.Lock()
_stance_users = 0
_stance_restore: Any = None


def _enter_eager() -> None:
    global _stance_users, _stance_restore
    with _stance_lock:
        if _stance_users == 0:  # the first hook set to attach; its __exit__ restores the stance, options included
            _stance_restore = torch.compiler.set_stance("force_eager")
        _stance_users += 1


def _exit_eager() -> None:
    global _stance_users, _stance_restore
    with _stance_lock:
        _stance_users -= 1
        if _stance_users == 0:  # the last one removed
            restore, _stance_restore = _stance_restore, None
            restore.__exit__(None, None, None)


def compiled_stance() -> contextlib.AbstractContextManager[Any]:
    """The compiler's default stance for a block, while hook sets hold ``force_eager``; else nothing changes.

    For the package's own compiled reduction (:mod:`lightning_hookdiag._onepass`), whose function has no hooks to lose:
    under the hooks' ``force_eager`` it would run its own body op by op. Only the stance the hooks set is lifted: with
    no hook set attached, a caller's own ``force_eager`` stays.
    """
    if _stance_users == 0:
        return contextlib.nullcontext()
    stance: contextlib.AbstractContextManager[Any] = torch.compiler.set_stance("default")
    return stance


class Companion(Protocol):
    """What a hook set drives beside its own hooks (a :class:`~lightning_hookdiag.components.Component` is one)."""

    def attach(self) -> None:
        """Install its hooks."""

    def end_micro_batch(self) -> None:
        """Keep what the micro-batch measured."""

    def remove(self) -> None:
        """Remove its hooks; idempotent."""


class HookSet:
    """Forward hooks (and optional output-gradient hooks) on a fixed, ordered set of modules.

    Hooks exist only between :meth:`attach` and :meth:`remove`, which is idempotent, removes only this set's hooks
    (also tensor hooks whose backward never ran) and runs on ``__exit__`` even when the body raises. While attached,
    ``torch.compile``-d code runs eagerly. Sinks are called under :func:`sink_mode`, with the module's index.

    Args:
        modules: Ordered ``{name: module}``; a sink receives the index of the module in this mapping.
        on_output: Receives every raw output but those recomputed inside backward (``None``: only ``on_tensor``).
        on_grad: If given, receives the gradient w.r.t. the first floating-point tensor of every output that
            requires grad.
        on_tensor: Like ``on_output``, with the output's first floating-point tensor (``None``: it has none).
        companions: Attached after this set's hooks, told the end of each micro-batch and removed with them: one
            lifecycle covers every hook of a sampled micro-batch, replays included (a fit's one companion is its
            :class:`~lightning_hookdiag.components.Parts`).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> seen = []
        >>> with HookSet(dict(net.named_children()), lambda i, out: seen.append((i, tuple(out.shape)))) as hooks:
        ...     _ = net(torch.zeros(4, 2))
        >>> seen, hooks.fired_names()
        ([(0, (4, 3)), (1, (4, 3))], ['0', '1'])
        >>> len(net[0]._forward_hooks)
        0
    """

    fired_order: list[int]
    """Indices of modules in the order their forward first ran since :meth:`clear_order`."""
    grad_order: list[int]
    """Indices of modules in the order their output gradient first arrived since :meth:`clear_order`."""

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        on_output: Callable[[int, Any], None] | None,
        on_grad: Callable[[int, Tensor], None] | None = None,
        on_tensor: Callable[[int, Tensor | None], None] | None = None,
        companions: Sequence[Companion] = (),
    ) -> None:
        self.names: list[str] = list(modules)
        self.modules: list[nn.Module] = list(modules.values())
        self.companions: tuple[Companion, ...] = tuple(companions)
        self._on_output, self._on_grad, self._on_tensor = on_output, on_grad, on_tensor
        self.attached = False
        """Whether hooks are registered (between :meth:`attach` and :meth:`remove`, also for no module)."""
        self._handles: list[RemovableHandle] = []
        self._tensor_handles: list[RemovableHandle] = []
        self.clear_order()
        # Built once so that attaching on a sampled step allocates nothing per module.
        self._forward_hooks = [self._make_forward_hook(i) for i in range(len(self.modules))]
        self._grad_hooks = [self._make_grad_hook(i, on_grad) for i in range(len(self.modules))] if on_grad else []

    def attach(self) -> HookSet:
        """Register a forward hook on every module (no-op if already attached)."""
        if self.attached:
            return self
        self.attached = True
        self._handles = [m.register_forward_hook(h) for m, h in zip(self.modules, self._forward_hooks, strict=True)]
        _enter_eager()
        for companion in self.companions:
            companion.attach()
        return self

    def remove(self, finished: bool = False) -> None:
        """Remove every hook this set registered, and its companions'; safe to call any number of times.

        ``finished``: the micro-batch ran to its end, so the companions keep what they measured in it (after an
        exception or an interrupted batch they forget it). Raises the first error a companion raised, once every hook
        and companion is removed.
        """
        for handle in (*self._handles, *self._tensor_handles):
            handle.remove()
        self._handles, self._tensor_handles = [], []
        if self.attached:
            self.attached = False
            _exit_eager()
        calls: list[Callable[[], object]] = []
        for c in self.companions:
            calls += [c.end_micro_batch, c.remove] if finished else [c.remove]
        call_all(calls)

    def end_micro_batch(self) -> None:
        """One micro-batch is over while the hooks stay attached (a replay runs a step's micro-batches in one go)."""
        for companion in self.companions:
            companion.end_micro_batch()

    def clear_order(self) -> None:
        """Forget which modules fired, to start observing a new step."""
        n = len(self.modules)
        self.fired_order, self.grad_order = [], []
        self._fired, self._grad_fired, self._grad_expected = [False] * n, [False] * n, [False] * n
        self._no_grad_calls = [0] * n

    def missing_grads(self) -> list[str]:
        """Modules whose output required grad in a forward since :meth:`clear_order` but received no gradient.

        A detached branch, or an output that does not reach the loss; meaningful once backward has run.
        """
        return [self.names[i] for i in self.missing_grad_layers()]

    def missing_grad_layers(self) -> list[int]:
        """Indices of the modules of :meth:`missing_grads`."""
        pairs = zip(self._grad_expected, self._grad_fired, strict=True)
        return [i for i, (want, got) in enumerate(pairs) if want and not got]

    def fired_names(self) -> list[str]:
        """Names of the modules that ran, in the order they first ran."""
        return [self.names[i] for i in self.fired_order]

    def __enter__(self) -> HookSet:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def _make_forward_hook(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():
                # Reentrant activation checkpointing runs the forward under no_grad, then again with grad inside
                # backward, where the gradient reaches only the recomputed output: hook that one, once per no-grad
                # call (its statistics were taken in the first run).
                if self._on_grad is not None and self._no_grad_calls[index]:
                    tensor = first_floating_tensor(output)
                    if tensor is not None and tensor.requires_grad:
                        self._no_grad_calls[index] -= 1
                        self._tensor_handles.append(tensor.register_hook(self._grad_hooks[index]))
                return
            if not self._fired[index]:
                self._fired[index] = True
                self.fired_order.append(index)
            tensor = first_floating_tensor(output) if self._on_tensor or self._on_grad else None
            with sink_mode():
                if self._on_output is not None:
                    self._on_output(index, output)
                if self._on_tensor is not None:
                    self._on_tensor(index, tensor)
            if self._on_grad is not None and tensor is not None:
                if tensor.requires_grad:
                    self._grad_expected[index] = True
                    self._tensor_handles.append(tensor.register_hook(self._grad_hooks[index]))
                elif not torch.is_grad_enabled():
                    self._no_grad_calls[index] += 1

        return hook

    def _make_grad_hook(self, index: int, on_grad: Callable[[int, Tensor], None]) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not self._grad_fired[index]:
                self._grad_fired[index] = True
                self.grad_order.append(index)
            with sink_mode():  # a backward with create_graph=True records its ops
                on_grad(index, grad.detach() if grad.requires_grad else grad)

        return hook
