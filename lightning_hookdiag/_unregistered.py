"""Layers that run in the training forward without being submodules: the facts of rule ``unregistered_module``.

Held in a Python list, tuple or dict, they are in no optimizer built from ``self.parameters()``, no checkpoint, and
``.to(device)`` does not move them. Which modules count: ``docs/rules.md#unregistered_module``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_hookdiag._names import ROOT
from lightning_hookdiag._selection import named_modules
from lightning_hookdiag._torch_internals import calling_modules, in_backward
from lightning_hookdiag.components import Component, Setup, WindowStart, component

__all__ = ["UnregisteredWatch", "unregistered_watch", "where_held"]


def where_held(parent: nn.Module, module: nn.Module) -> str:
    """How ``parent`` holds ``module`` outside its submodules: ``"layers[1]"``, ``"heads['a']"``, or ``""``."""
    for attr, value in vars(parent).items():
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if item is module:
                    return f"{attr}[{i}]"
        elif isinstance(value, dict) and not attr.startswith("_"):
            for key, item in value.items():
                if item is module:
                    return f"{attr}[{key!r}]"
        elif value is module:
            return attr
    return ""


class UnregisteredWatch(Component):
    """Collect the unregistered modules with trainable parameters of their own that ran in a sampled training forward.

    ``root``: the LightningModule. Which modules count, and why: ``docs/rules.md#unregistered_module``.
    """

    replays = False
    provides = ("unregistered",)

    def __init__(self, root: nn.Module) -> None:
        self._names = {id(m): name for name, m in named_modules(root).items()}
        self._names[id(root)] = ROOT
        self._params = {id(p) for p in root.parameters()}
        self._found: dict[str, list[str]] = {}
        self._seen: set[int] = set()

    @override
    def attach(self) -> None:
        if not self.attached:
            self.hold().enter_context(nn.modules.module.register_module_forward_hook(self._hook))

    @override
    def end_forward(self, loss: Tensor | None) -> None:
        self.remove()

    @override
    def reset(self, window: WindowStart) -> None:
        self._found, self._seen = {}, set()

    def facts(self, host: Mapping[str, list[float]]) -> dict[str, Any]:
        """``unregistered``: each innermost registered caller to the unregistered modules its forward ran."""
        found, self._found = self._found, {}
        self._seen = set()
        return {"unregistered": found}

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in self._names or id(module) in self._seen:
            return  # every registered module: one dictionary lookup
        if not torch.is_grad_enabled() or in_backward():
            return
        if not any(p.requires_grad and id(p) not in self._params for p in module.parameters(recurse=False)):
            return
        # The innermost registered module on the call stack (ROOT at worst), and the outermost unregistered module on
        # the way to ``module``: the layer it holds unregistered.
        parent, parent_name, outer = None, ROOT, module
        for candidate in calling_modules(2):
            if (name := self._names.get(id(candidate))) is not None:
                parent, parent_name = candidate, name
                break
            if isinstance(candidate, nn.Module):
                outer = candidate
        for m in outer.modules():
            self._seen.add(id(m))  # the layer held unregistered is reported once, with everything it holds
        held = where_held(parent, outer) if parent is not None else ""
        elements = sum(p.numel() for p in outer.parameters() if p.requires_grad and id(p) not in self._params)
        what = f"{held or 'a module'} ({type(outer).__name__}, {elements} parameter elements)"
        self._found.setdefault(parent_name, []).append(what)


@component
def unregistered_watch(setup: Setup) -> UnregisteredWatch | None:
    """The fit's :class:`UnregisteredWatch`, when rule ``unregistered_module`` is enabled."""
    return UnregisteredWatch(setup.model) if "unregistered_module" in setup.config.rules else None
