"""Modules left in eval mode during training: the facts of rule ``eval_mode``.

Which modules count, and which stay silent: ``docs/rules.md#eval_mode-when-the-mode-is-read``. Watching the mode
during each forward would need a hook on every such module; :class:`EvalModeWatch` reads ``module.training`` at two
points that bracket ``training_step`` instead (microseconds per sampled batch, no hook), wrong only if
``training_step`` itself switched a module to train and back around its forward, which nobody does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from typing_extensions import override

from lightning_hookdiag._selection import named_modules
from lightning_hookdiag._torch_internals import DROPOUT_BASE, MODE_DEPENDENT
from lightning_hookdiag.components import Component, Setup, WindowStart, component

__all__ = ["EvalModeWatch", "eval_mode_modules", "eval_mode_watch", "mode_dependent_modules"]


def mode_dependent_modules(root: nn.Module) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Every BatchNorm and Dropout module of ``root`` by logged name, to ``(module, owner)``.

    ``owner``, whose parameters it trains along, is the module itself if it has parameters, else its nearest ancestor
    with any (``root`` at worst).
    """
    modules = named_modules(root)
    found: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name, module in modules.items():
        if not isinstance(module, MODE_DEPENDENT):
            continue
        owner, parent = module, name
        while not any(True for _ in owner.parameters()) and parent:
            parent = parent.rpartition(".")[0]
            owner = modules.get(parent, root) if parent else root
        found[name] = (module, owner)
    return found


def eval_mode_modules(candidates: Mapping[str, tuple[nn.Module, nn.Module]]) -> dict[str, str]:
    """The candidates in eval mode now whose mode matters and whose owner has a parameter that requires grad.

    Name to class name (``"BatchNorm2d"``), in the order of ``candidates`` (as :func:`mode_dependent_modules` gives).
    """
    return {
        name: type(module).__name__
        for name, (module, owner) in candidates.items()
        if not module.training
        # Without running statistics, eval mode normalises with the batch's statistics too: the mode does not matter.
        and (module.p > 0 if isinstance(module, DROPOUT_BASE) else module.running_mean is not None)
        and any(p.requires_grad for p in owner.parameters())
    }


class EvalModeWatch(Component):
    """Collect the modules that ran a sampled step's training forwards in eval mode.

    The two points: :meth:`attach` (the batch starts) and :meth:`end_forward` (its loss is handed to backward).
    """

    replays = False
    provides = ("eval_mode",)

    def __init__(self, root: nn.Module) -> None:
        self._candidates = mode_dependent_modules(root)
        self._at_start: dict[str, str] = {}
        self._found: dict[str, str] = {}

    @override
    def attach(self) -> None:
        if not self.attached:
            self._at_start = eval_mode_modules(self._candidates) if self._candidates else {}
            self.hold().callback(self._at_start.clear)

    @override
    def end_forward(self, loss: Tensor | None) -> None:
        if self._at_start:
            now = eval_mode_modules(self._candidates)
            self._found.update((name, kind) for name, kind in self._at_start.items() if name in now)
        self.remove()

    @override
    def reset(self, window: WindowStart) -> None:
        self._found = {}

    @override
    def facts(self, host: Mapping[str, list[float]]) -> dict[str, Any]:
        found, self._found = self._found, {}
        return {"eval_mode": found}


@component
def eval_mode_watch(setup: Setup) -> EvalModeWatch | None:
    """The fit's :class:`EvalModeWatch`, when rule ``eval_mode`` is enabled."""
    return EvalModeWatch(setup.model) if "eval_mode" in setup.config.rules else None
