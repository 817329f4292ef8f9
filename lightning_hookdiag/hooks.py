"""The hook lifecycle: attach forward hooks (and output tensor hooks) to resolved modules, remove every one of them.

:class:`HookSet` knows nothing about statistics: it hands each module's output, and later the gradient flowing
into that output, to the sinks it was given, and records which modules fired and in what order.

Activation gradients come from a tensor hook registered on the module's output inside the forward hook, never
from ``register_full_backward_hook``: the latter wraps outputs in a ``BackwardHookFunction`` view and breaks as soon
as an in-place op such as ``nn.ReLU(inplace=True)`` follows the module. A tensor hook registered before an in-place
op receives the gradient with respect to the value the module produced, which is exactly what we want.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hookdiag.components import Component
from lightning_hookdiag.torch_internals import in_backward

__all__ = ["HookSet", "first_floating_tensor", "in_backward"]

ForwardSink = Callable[[int, Any], None]
"""Called as ``sink(layer_index, output)`` with the module's raw output, under ``torch.no_grad()``."""
TensorSink = Callable[[int, Tensor | None], None]
"""Called as ``sink(layer_index, tensor)`` with the first floating-point tensor of the output (``None``: none)."""
GradSink = Callable[[int, Tensor], None]
"""Called as ``sink(layer_index, grad)`` with the gradient of the loss w.r.t. the module's output."""


def first_floating_tensor(output: Any) -> Tensor | None:
    """The first floating-point tensor in ``output``, searched depth-first through tuples, lists and dicts.

    Example:
        >>> first_floating_tensor((torch.tensor([1]), {"h": torch.tensor([1.5])}))
        tensor([1.5000])
    """
    if isinstance(output, Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, (tuple, list)):
        items: Any = output
    elif isinstance(output, Mapping):
        items = output.values()
    else:
        return None
    for item in items:
        found = first_floating_tensor(item)
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def sink_mode() -> Iterator[None]:
    """What a sink runs under: no grad, and never inference mode.

    A module may run under ``torch.inference_mode()`` during a sampled step (a target computed with the same layers
    inside ``training_step``). Tensors a sink creates there would be inference tensors, and the scratch kept across
    calls (the aggregator's call table, the workspace) could not be written outside inference mode afterwards; so
    sinks leave it (reading an inference tensor outside inference mode is allowed, without grad).
    """
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            yield
    else:
        with torch.no_grad():
            yield


# One process-wide count of the hook sets that want eager execution: the stance is global, so the first to enter
# saves it and the last to leave restores it, whatever order callbacks and ``capture_activations`` blocks remove
# their hooks in (each set restoring "its" prior stance leaked ``force_eager`` when two sets overlapped).
_stance_lock = threading.Lock()
_stance_users = 0
_stance_restore: Any = None


def _enter_eager() -> None:
    # Compiled code runs eagerly while hooks are attached: Dynamo does not guard on module hooks
    # (``skip_nnmodule_hook_guards``), so a compiled graph silently ignores hooks added later. The ``force_eager``
    # stance runs every ``torch.compile``-d callable's Python code without touching the compile cache, so unsampled
    # steps keep using the compiled code and nothing recompiles.
    global _stance_users, _stance_restore
    with _stance_lock:
        if _stance_users == 0:
            # The public API (torch >= 2.6): calling it sets the stance and returns an object whose ``__exit__``
            # restores the previous one, options included.
            _stance_restore = torch.compiler.set_stance("force_eager")
        _stance_users += 1


def _exit_eager() -> None:
    global _stance_users, _stance_restore
    with _stance_lock:
        _stance_users -= 1
        if _stance_users == 0:
            restore, _stance_restore = _stance_restore, None
            restore.__exit__(None, None, None)


class HookSet:
    """Forward hooks (and optional output-gradient hooks) on a fixed, ordered set of modules.

    Hooks exist only between :meth:`attach` and :meth:`remove`. ``remove`` is idempotent, removes only the hooks
    this object registered (including tensor hooks whose backward never ran) and is called on ``__exit__`` even
    when the body raises.

    Args:
        modules: Ordered ``{name: module}``; sinks receive the index of the module in this mapping.
        on_output: Receives every raw output, under ``torch.no_grad()``; recomputations inside backward are
            skipped. ``None``: only ``on_tensor``.
        on_grad: If given, receives the gradient w.r.t. the first floating-point tensor of every output that
            requires grad.
        on_tensor: Like ``on_output``, but receives the output's first floating-point tensor (``None`` when it
            has none), searched once per call for this sink and the gradient hook together.
        companions: Attached after this set's hooks, told the end of each micro-batch and removed with them, so
            that one lifecycle covers every hook of a sampled micro-batch, replays included.

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

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        on_output: ForwardSink | None,
        on_grad: GradSink | None = None,
        on_tensor: TensorSink | None = None,
        companions: Sequence[Component] = (),
    ) -> None:
        self.names: list[str] = list(modules)
        self.companions: tuple[Component, ...] = tuple(companions)
        self.modules: list[nn.Module] = list(modules.values())
        self._on_output = on_output
        self._on_tensor = on_tensor
        self._on_grad = on_grad
        self._handles: list[RemovableHandle] = []
        self._attached = False
        self._tensor_handles: list[RemovableHandle] = []
        self.fired_order: list[int] = []
        """Indices of modules in the order their forward first ran since :meth:`clear_order`."""
        self.grad_order: list[int] = []
        """Indices of modules in the order their output gradient first arrived since :meth:`clear_order`."""
        self._fired = [False] * len(self.modules)
        self._grad_fired = [False] * len(self.modules)
        self._grad_expected = [False] * len(self.modules)
        self._no_grad_calls = [0] * len(self.modules)
        # Built once so attaching on a sampled step allocates nothing per module.
        self._forward_hooks = [self._make_forward_hook(i) for i in range(len(self.modules))]
        self._grad_hooks = [self._make_grad_hook(i) for i in range(len(self.modules))]

    @property
    def attached(self) -> bool:
        """Whether hooks are currently registered (between :meth:`attach` and :meth:`remove`, also for no module)."""
        return self._attached

    def attach(self) -> HookSet:
        """Register a forward hook on every module (no-op if already attached)."""
        if self._attached:
            return self
        self._attached = True
        self._handles = [m.register_forward_hook(h) for m, h in zip(self.modules, self._forward_hooks, strict=True)]
        _enter_eager()
        for companion in self.companions:
            companion.attach()
        return self

    def remove(self, finished: bool = False) -> None:
        """Remove every hook this set registered, and its companions'; safe to call any number of times.

        Args:
            finished: The micro-batch ran to its end, so the companions keep what they measured in it; otherwise
                (an exception, an interrupted batch) they forget it.
        """
        if self._attached:
            _exit_eager()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for handle in self._tensor_handles:
            handle.remove()
        self._tensor_handles = []
        self._attached = False
        for companion in self.companions:
            if finished:
                companion.end_micro_batch()
            companion.remove()

    def end_micro_batch(self) -> None:
        """One micro-batch is over while the hooks stay attached (a replay runs a step's micro-batches in one go)."""
        for companion in self.companions:
            companion.end_micro_batch()

    def clear_order(self) -> None:
        """Forget which modules fired, to start observing a new step."""
        self.fired_order = []
        self.grad_order = []
        self._fired = [False] * len(self.modules)
        self._grad_fired = [False] * len(self.modules)
        self._grad_expected = [False] * len(self.modules)
        self._no_grad_calls = [0] * len(self.modules)

    def missing_grads(self) -> list[str]:
        """Modules whose output required grad in a forward since :meth:`clear_order` but received no gradient.

        A detached branch, or an output that does not reach the loss; meaningful once backward has run.
        """
        return [
            self.names[i]
            for i, (want, got) in enumerate(zip(self._grad_expected, self._grad_fired, strict=True))
            if want and not got
        ]

    def fired_names(self) -> list[str]:
        """Names of the modules that ran, in the order they first ran."""
        return [self.names[i] for i in self.fired_order]

    def __enter__(self) -> HookSet:
        return self.attach()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def _make_forward_hook(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():
                # Reentrant activation checkpointing runs the forward under no_grad, then again with grad inside
                # backward, where the gradient reaches only the recomputed output: hook that one, once per
                # no-grad call (its statistics were taken in the first run).
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
            if self._on_grad is not None:
                if tensor is not None and tensor.requires_grad:
                    self._grad_expected[index] = True
                    self._tensor_handles.append(tensor.register_hook(self._grad_hooks[index]))
                elif tensor is not None and not torch.is_grad_enabled():
                    self._no_grad_calls[index] += 1

        return hook

    def _make_grad_hook(self, index: int) -> Callable[[Tensor], None]:
        on_grad = self._on_grad

        def hook(grad: Tensor) -> None:
            if not self._grad_fired[index]:
                self._grad_fired[index] = True
                self.grad_order.append(index)
            if on_grad is not None:
                with sink_mode():  # a backward with create_graph=True records its ops
                    on_grad(index, grad.detach() if grad.requires_grad else grad)

        return hook
