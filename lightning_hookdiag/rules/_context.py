"""What a rule reads on one step: the :class:`Observed` facts and the rules' :class:`Memory`, in a :class:`Context`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeGuard

from lightning_hookdiag import _trends as trends
from lightning_hookdiag._names import BATCH, ROOT, owning_layer
from lightning_hookdiag._step_state import Trip
from lightning_hookdiag.rules._config import RuleConfig

__all__ = [
    "CORE_FACTS",
    "MEMORY",
    "Baseline",
    "Context",
    "Memory",
    "Observed",
    "Orders",
    "ParamFacts",
    "finite",
    "first_positions",
    "stat",
]


class Orders:
    """Positions of layers in forward and backward order, with documented fallbacks for layers missing from one.

    Args:
        forward_order: Layers in the order their forward first ran; a module called twice sorts at its first call.
        backward_order: Layers in the order their output gradient arrived.
        trip: A replayed trip that traced a NaN/Inf to code between two layers: the module that made it (or
            :data:`~lightning_hookdiag._names.ROOT`) sorts where the first non-finite selected layer does.
    """

    def __init__(self, forward_order: Sequence[str], backward_order: Sequence[str], trip: Trip | None = None) -> None:
        forward, backward = first_positions(forward_order), first_positions(backward_order)
        self.layers = frozenset(forward.keys() | backward.keys())
        if trip is not None and trip.nan_entry in forward:
            forward.setdefault(trip.nan_origin or ROOT, forward[trip.nan_entry])
        self.forward: Mapping[str, int] = MappingProxyType(forward)
        self.backward: Mapping[str, int] = MappingProxyType(backward)
        self.forward_layers = tuple(sorted(forward, key=forward.__getitem__))
        self.backward_layers = tuple(sorted(backward, key=backward.__getitem__))

    def owner(self, param: str) -> str:
        """The observed layer that owns parameter ``param`` (see :func:`~lightning_hookdiag._names.owning_layer`)."""
        return owning_layer(param, self.layers)

    def owners(self, params: Iterable[str]) -> list[str]:
        """The layers that own ``params``, each once, in forward order."""
        return sorted({self.owner(p) for p in params}, key=self.forward_key)

    def forward_key(self, layer: str) -> tuple[int, int, str]:
        """Sort key of ``layer`` in forward order; the batch first, layers of unknown position last, by name."""
        if layer == BATCH:
            return (-1, 0, "")
        if layer in self.forward:
            return (0, self.forward[layer], "")
        return (1, 0, layer)

    def backward_key(self, layer: str) -> tuple[int, int, str]:
        """Sort key of ``layer`` in backward order; unrecorded ones in reversed forward order, then by name."""
        if layer in self.backward:
            return (0, self.backward[layer], "")
        # Without a recorded backward order (no gradient hooks), reversed forward order is exact for a chain of
        # modules and the best available guess otherwise.
        if layer in self.forward:
            return (1, -self.forward[layer], "")
        return (2, 0, layer)


def first_positions(names: Sequence[str]) -> dict[str, int]:
    """Each name's index in ``names`` at its first occurrence."""
    positions: dict[str, int] = {}
    for i, name in enumerate(names):
        positions.setdefault(name, i)
    return positions


def stat(values: Mapping[str, Mapping[str, float]], name: str) -> Mapping[str, float]:
    """The values of statistic ``name`` per layer or parameter; empty when it is absent."""
    return values.get(name) or {}


def finite(x: object) -> TypeGuard[float]:
    """Whether ``x`` is a finite ``int`` or ``float`` (a ``bool`` is not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class ParamFacts:
    """Host facts about one tracked parameter on a sampled step, which ``not_updated`` reads beside its statistics.

    Attributes:
        held: Whether an optimizer of the Trainer holds the parameter in one of its param groups.
        applied: Whether an optimizer that holds it ran its step (not skipped by an fp16 ``GradScaler`` for an
            overflow, or by a ``training_step`` that returned ``None``).
        lr: The learning rate it was stepped with (the largest of the groups that hold it); NaN if unknown.
        base_lr: The lr an LR scheduler scales (the group's ``initial_lr``), ``None`` without a scheduler.
        dtype: Name of the weights' dtype, for the message (``"bfloat16"``).
        eps: ``torch.finfo(dtype).eps`` of the weights: the gap between 1 and the next representable number.
        tiny: The smallest positive number of the weights' dtype (its smallest subnormal; ``5.96e-08`` in float16).
        opt_eps: The ``eps`` of the param group (Adam's denominator term), ``None`` where the group has none.
        interval: How Lightning steps the LR scheduler of the optimizer (``"step"`` or ``"epoch"``), ``None``
            without one.
        scheduler_steps: How many times that scheduler has stepped (its ``last_epoch``), ``None`` if unknown.
        scheduler_advance: Since the previous sampled step on which that optimizer was seen: ``(times the scheduler
            stepped, the most times Lightning can have stepped it, the Lightning clock then)``; the clock is the
            optimizer step for ``interval="step"`` and the epoch for ``"epoch"``. ``None`` on the first sampled step,
            under manual optimization (Lightning steps no scheduler) and without a scheduler.
        optimizers: The index, in the Trainer's list of optimizers, of each optimizer whose param groups hold the
            parameter, once per time it is held (``(0, 0)``: twice in one optimizer), read at the step.
        shape: The parameter's shape (a weight's fan-in, for ``input_scale``).

    Example:
        >>> ParamFacts(held=True, lr=0.1, dtype="bfloat16", eps=2**-7).eps
        0.0078125
    """

    held: bool
    applied: bool = True
    lr: float = math.nan
    base_lr: float | None = None
    dtype: str = "float32"
    eps: float = 2.0**-23
    tiny: float = 2.0**-149
    opt_eps: float | None = None
    interval: str | None = None
    scheduler_steps: int | None = None
    scheduler_advance: tuple[int, int, int] | None = None
    optimizers: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Baseline:
    """The values of an earlier, regular sampled step, for rules that compare against the recent past.

    Attributes:
        step: The optimizer step the values describe.
        values: As :attr:`Observed.values`.
    """

    step: int
    values: Mapping[str, Mapping[str, float]]


CORE_FACTS = frozenset(
    {
        "forward_order",
        "backward_order",
        "trip",
        "layer_types",
        "missing_grads",
        "param_facts",
        "param_stale_grad_norm",
        "param_norm_min",
    }
)
"""The facts the engine itself gathers (the rest come from the components that the enabled rules need)."""

MEMORY = frozenset({"baseline", "last_finite", "history"})
"""The parts of :class:`Memory` a rule may name in ``reads``."""


@dataclass(frozen=True)
class Observed:
    """One step as the rules read it: its logged statistics and every other fact, each by name.

    Attributes:
        step: The optimizer step, copied into each finding.
        values: Statistic name to ``{layer or parameter name: value}``; any statistic may be absent.
        facts: Everything else the rules read, by name; any fact may be absent. The engine's (:data:`CORE_FACTS`):
            ``forward_order`` and ``backward_order`` (layers in the order their forward first ran, and their output
            gradient arrived), ``trip`` (the sentinel's :class:`~lightning_hookdiag._step_state.Trip` when it tripped
            on this step), ``layer_types`` (layer to module class name), ``missing_grads`` (layers whose output
            required grad but got none), ``param_facts`` (parameter name to :class:`ParamFacts`), and the per-name
            numbers the rules read but the step does not log (``param_stale_grad_norm``, ``param_norm_min``). The
            components' (``eval_mode``, ``unregistered``, ``batch_repeated``, a user component's) by the names their
            ``facts`` return.

    Example:
        >>> Observed(3, {"act_std": {"fc": 0.5}}, {"forward_order": ["fc"]}).facts["forward_order"]
        ['fc']
    """

    step: int
    values: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Memory:
    """What the rules remember of earlier evaluated steps (:class:`~lightning_hookdiag._diagnosis.Diagnosis` keeps it).

    Attributes:
        baseline: The last step evaluated without a trip: what ``loss_spike`` and ``update_ratio`` compare with.
        last_finite: Parameter name to the last evaluated step its ``param_norm`` was finite.
        history: The recent sampled steps' values, for the trend rules.
    """

    baseline: Baseline | None = None
    last_finite: Mapping[str, int] = field(default_factory=dict)
    history: trends.History | None = None


class Context:
    """What every rule reads on one step: its facts by name, the rules' memory and the configuration; read-only.

    Args:
        observed: The step.
        memory: What earlier steps left.
        config: The thresholds.
        enabled: The names of the rules that run on the step.
    """

    def __init__(self, observed: Observed, memory: Memory, config: RuleConfig, enabled: Iterable[str] = ()) -> None:
        self.step = observed.step
        self.config = config
        self.enabled = frozenset(enabled)
        self.memory = memory
        self.values: Mapping[str, Mapping[str, float]] = MappingProxyType(dict(observed.values))
        self.facts: Mapping[str, Any] = MappingProxyType(dict(observed.facts))
        self.orders = Orders(self.fact("forward_order", ()), self.fact("backward_order", ()), self.trip)

    @property
    def trip(self) -> Trip | None:
        """What the sentinel saw, when it tripped on this step (the fact ``trip``)."""
        found: Trip | None = self.facts.get("trip")
        return found

    @property
    def baseline(self) -> Baseline | None:
        """The memory's baseline (:class:`Memory`)."""
        return self.memory.baseline

    @property
    def last_finite(self) -> Mapping[str, int]:
        """The memory's last finite steps (:class:`Memory`)."""
        return self.memory.last_finite

    @property
    def history(self) -> trends.History | None:
        """The memory's history (:class:`Memory`)."""
        return self.memory.history

    def fact(self, name: str, default: Any = None) -> Any:
        """The fact ``name`` of the step, or ``default`` when it is absent."""
        return self.facts.get(name, default)

    def has(self, name: str) -> bool:
        """Whether the fact or memory part ``name`` is present and not empty (what a rule's ``reads`` asks)."""
        if name in MEMORY:
            return bool(getattr(self.memory, name))
        return bool(self.facts.get(name))

    def stat(self, name: str) -> Mapping[str, float]:
        """The values of statistic ``name`` per layer or parameter; empty when it is absent.

        A per-name number the step does not log (``param_stale_grad_norm``) is read from the facts of that name.
        """
        return stat(self.values, name) or self.facts.get(name) or {}

    def positive(self, name: str) -> dict[str, float]:
        """The finite values of statistic ``name`` that are ``> 0``."""
        return {k: v for k, v in self.stat(name).items() if finite(v) and v > 0}
