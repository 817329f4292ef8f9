"""What the model is at the sampled step, read then and not at fit start: the facts of the participation rules.

Issue 38's principles 1 and 2, as host facts of each sampled step
(``docs/rules.md#parameters-and-modules-read-at-the-step``):

- ``stopped_layers``: selected layers that ran on every sampled step from the first one, then on none of the last
  ones (a branch gated on the wrong clock): ``stopped_running``.
- ``trainable``: the logged names of the parameters that require grad now, for ``output_unused`` (a module whose
  output never reaches the loss while its trainable parameters sit in an optimizer).
- ``shadowed``: parameters whose Tensor method or property is hidden by an instance attribute of the same name
  (``p.requires_grad_ = True``, a typo for ``p.requires_grad = True``, sets an attribute and freezes nothing free):
  ``shadowed_method``.

Pure host work: one pass over the model's parameters and the layers' call counts that the step reads back anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_hookdiag._params import owned_parameters
from lightning_hookdiag.components import Component, Setup, component

__all__ = [
    "STOPPED_FOR",
    "STOP_AFTER",
    "TENSOR_ATTRIBUTES",
    "Participation",
    "RunRecord",
    "model_picture",
    "participation_watch",
    "shadowed_attributes",
]

STOP_AFTER = 3
"""A layer must have run on at least this many sampled steps, each of them, before its stop is a finding."""

STOPPED_FOR = (3, 8)
"""...and then not run on as many sampled steps in a row as it ran, at least the first and at most the second number:
a layer dropped at random (LayerDrop at rate p) passes that test with a chance of about ``(p (1 - p))**3``, 0.07 %
per layer at p = 0.1 (docs/rules.md#parameters-and-modules-read-at-the-step)."""

TENSOR_ATTRIBUTES = frozenset(name for name in dir(torch.Tensor) if not name.startswith("__"))
"""The names of ``torch.Tensor``'s methods and properties: an instance attribute of a parameter under one hides it."""


def model_picture(model: nn.Module) -> tuple[int, ...]:
    """The identities of ``model``'s modules, in order: it changes when a module is added, removed or replaced.

    The callback reads the model when the fit starts, before the LightningModule's own ``setup`` and
    ``on_fit_start`` run; a head replaced there (or later) is read again at the next sampled step when this changes.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> before = model_picture(net)
        >>> net[1] = nn.Tanh()
        >>> model_picture(net) == before
        False
    """
    return tuple(id(m) for m in model.modules())


def shadowed_attributes(params: Mapping[str, Tensor]) -> dict[str, tuple[str, ...]]:
    """Each of ``params`` (name to parameter) whose instance attributes hide a Tensor method or property.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> lin.weight.requires_grad_ = True  # the typo: sets an attribute, calls nothing
        >>> lin.bias.note = "mine"  # an attribute of one's own hides nothing
        >>> shadowed_attributes(dict(lin.named_parameters()))
        {'weight': ('requires_grad_',)}
    """
    found: dict[str, tuple[str, ...]] = {}
    for name, param in params.items():
        own = getattr(param, "__dict__", {})
        hidden = tuple(sorted(attr for attr in own if attr in TENSOR_ATTRIBUTES))
        if hidden:
            found[name] = hidden
    return found


@dataclass
class RunRecord:
    """How a layer took part in the sampled steps of a fit so far.

    Attributes:
        ran: On how many sampled steps it ran, each of them from the first (it stops counting once it missed one).
        absent: On how many sampled steps in a row it did not run since it last ran.
        steady: It ran on every sampled step until it first missed one; ``False`` once it ran again after a miss
            (a layer skipped at random, or run every other step, is never a stop).
    """

    ran: int = 0
    absent: int = 0
    steady: bool = True

    def update(self, ran: bool) -> None:
        """Count one sampled step on which the layer ran (``ran``) or not."""
        if ran:
            if self.absent:  # ran again after a miss: it takes part now and then, by design
                self.steady = False
            self.absent = 0
            if self.steady:
                self.ran += 1
        else:
            self.absent += 1

    @property
    def stopped(self) -> bool:
        """Whether it ran on each of at least :data:`STOP_AFTER` sampled steps, then on none of :data:`STOPPED_FOR`."""
        low, high = STOPPED_FOR
        return self.steady and self.ran >= STOP_AFTER and self.absent >= min(max(self.ran, low), high)


class Participation(Component):
    """Read at each sampled step: which layers stopped running, which parameters require grad, which hide a method.

    Args:
        model: The LightningModule, read at each sampled step.
        layers: The selected layers' names, in the order of the step's per-layer values.
    """

    replays = False
    provides = ("stopped_layers", "trainable", "shadowed")

    def __init__(self, model: nn.Module, layers: list[str]) -> None:
        self.model = model
        self.layers = layers
        self.records = [RunRecord() for _ in layers]

    @override
    def facts(self, host: Mapping[str, list[float]]) -> dict[str, Any]:
        """``stopped_layers`` (name to ``(ran, absent)`` sampled steps), ``trainable``, ``shadowed``."""
        counts = host.get("count", [])
        # A window of parameters only (nothing ran in it) says nothing about which layers run.
        if len(counts) == len(self.layers) and any(c > 0 for c in counts):
            for record, count in zip(self.records, counts, strict=True):
                record.update(count > 0)
        stopped = {
            name: (record.ran, record.absent)
            for name, record in zip(self.layers, self.records, strict=True)
            if record.stopped
        }
        params = owned_parameters(self.model)
        return {
            "stopped_layers": stopped,
            "trainable": frozenset(name for name, p in params.items() if p.requires_grad),
            "shadowed": shadowed_attributes(params),
        }


_RULES = frozenset({"stopped_running", "output_unused", "idle_optimizer", "shadowed_method"})


@component
def participation_watch(setup: Setup) -> Participation | None:
    """The fit's :class:`Participation`, when one of the rules that read its facts is enabled."""
    if not _RULES & setup.config.rules:
        return None
    return Participation(setup.model, list(setup.modules))
