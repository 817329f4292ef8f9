"""The one extension interface of a fit: every optional part is a :class:`Component`.

:class:`~lightning_hookdiag.fit_run.FitRun` builds each from a factory registered with :func:`component` (``None``:
not configured) and drives every one through the same calls, in this order within a window:

``reset`` (a window opens) → per micro-batch ``observe_batch``, ``attach``, ``on_output`` / ``on_grad`` (per hooked
tensor), ``end_forward``, ``end_micro_batch``, ``remove`` → ``fold`` (pool into the aggregator's states) →
``finalize`` (pooled device values that join the one host transfer) → ``facts`` (host facts for the
:class:`~lightning_hookdiag.logged_values.ObservedStep`).

A component that pools declares its states in its factory
(:meth:`~lightning_hookdiag.aggregation.LayerStatsAggregator.add_state`) and adds into them with
:meth:`~lightning_hookdiag.aggregation.LayerStatsAggregator.pool`; they ride in the core states' two packed
all-reduces. Every method defaults to doing nothing, and the recorder hands tensors only to components that define
``on_output`` / ``on_grad``: the default path pays nothing.

Example:
    >>> from lightning_hookdiag.hooks import module_hook  # a plain function: deepcopy(module) shares it
    >>> class Calls(Component):  # counts a module's forward calls in sampled micro-batches
    ...     def __init__(self, module): self.module, self.n = module, 0
    ...     def attach(self):
    ...         if not self.attached:
    ...             self.hold().enter_context(self.module.register_forward_hook(module_hook(self.count)))
    ...     def count(self, module, args, output): self.n += 1
    >>> calls = Calls(nn.Linear(2, 2))
    >>> calls.attach(); calls.attach(); _ = calls.module(torch.ones(2)); calls.remove(); calls.remove()
    >>> _ = calls.module(torch.ones(2))  # removed: not counted
    >>> calls.n, calls.attached
    (1, False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_hookdiag.aggregation import LayerStatsAggregator

__all__ = ["FACTORIES", "Component", "FitConfig", "Setup", "WindowStart", "call_all", "component"]

TensorSink = Callable[[int, Tensor], None]


@dataclass(frozen=True)
class FitConfig:
    """What a fit's run objects need of the callback's configuration.

    Each field is the callback's argument of its name, validated and resolved (``stats=`` with ``extra_stats=``; see
    :class:`~lightning_hookdiag.LayerHealthCallback`), except those derived from ``sentinel=`` and ``rules=``:

    Attributes:
        sentinel_grads: The sentinel also checks the selected parameters' gradients (``"loss+grads"``).
        rules: The enabled rules; a component that feeds one rule only is built when that rule is enabled.
    """

    every_n_steps: int
    layers: list[str] | None
    layer_types: tuple[type[nn.Module], ...] | None
    exclude: list[str]
    stats: tuple[str, ...]
    prefix: str
    dead_unit_types: tuple[type[nn.Module], ...]
    unit_dim: int | None
    histogram_every_n_steps: int | None
    histogram_bins: int
    precision_targets: Sequence[str] | None
    output_layer: str | None
    sentinel_grads: bool
    rules: frozenset[str]
    charts: str = "default"


@dataclass(frozen=True)
class Setup:
    """What a factory may read when a fit starts.

    Attributes:
        config: The callback's configuration (:class:`FitConfig`).
        model: The LightningModule.
        modules: The selected ``{name: module}``; layer indices refer to this order.
        plan: The :class:`~lightning_hookdiag.opt_in.OptInPlan` of the fit (``Any``: ``opt_in`` imports this module).
        aggregator: The aggregator to register states on.
    """

    config: FitConfig
    model: nn.Module
    modules: Mapping[str, nn.Module]
    plan: Any
    aggregator: LayerStatsAggregator


@dataclass(frozen=True)
class WindowStart:
    """A window opens.

    Attributes:
        device: Where the statistics live.
        previous: Per-layer values of a statistic as the previous sampled step logged them (``0.0`` where none).
    """

    device: torch.device
    previous: Callable[[str], list[float]]


class Component:
    """An optional part of a fit; see the module docstring for when each method is called."""

    replays: ClassVar[bool] = True
    """Whether the component also watches a tripped step's replay (the watches of training forwards do not)."""
    logged: ClassVar[tuple[str, ...]] = ()
    """Per-layer statistics :meth:`finalize` returns that are logged like the opt-in ones (``<prefix>/<stat>/<layer>``,
    in windows that observe layers; NaN: undefined, not logged). Those of ``stats=`` are named by the plan."""
    _exits: ExitStack | None = None

    def reset(self, window: WindowStart) -> None:
        """A window opens: forget the previous one's measurements."""

    def observe_batch(self, batch: Any) -> None:
        """A sampled training micro-batch starts with ``batch``."""

    def attach(self) -> None:
        """Install the hooks of one sampled micro-batch into :meth:`hold` (no-op if :attr:`attached`).

        The default only marks the component attached. The recorder hands tensors to attached components only, so an
        override that defines ``on_output`` / ``on_grad`` must enter its hooks into :meth:`hold` (or call this).
        """
        self.hold()

    on_output: TensorSink | None = None
    """Called as ``on_output(layer, tensor)`` with every observed output tensor (non-empty, strided, floating), under
    ``torch.no_grad()``; ``None``: none needed."""
    on_grad: TensorSink | None = None
    """Called as ``on_grad(layer, grad)`` with every observed output gradient; ``None``: none needed (a component
    that sets it makes the hook set hook gradients)."""

    @property
    def attached(self) -> bool:
        """Whether what :meth:`hold` holds is installed."""
        return self._exits is not None

    def hold(self) -> ExitStack:
        """Where :meth:`attach` enters its hook handles and contexts, for :meth:`remove` to undo (last first)."""
        if self._exits is None:
            self._exits = ExitStack()
        return self._exits

    def end_forward(self, loss: Tensor | None) -> None:
        """The micro-batch's forward is over; ``loss`` is what is back-propagated (``None`` in a replay)."""

    def end_micro_batch(self) -> None:
        """The micro-batch (or an optimizer closure) ran to its end: keep what it measured."""

    def remove(self) -> None:
        """Undo what :meth:`hold` holds and forget an unfinished micro-batch's measurement; idempotent."""
        exits, self._exits = self._exits, None
        if exits is not None:
            exits.close()

    def fold(self) -> None:
        """Pool this process's window into the registered states, before they are reduced over processes."""

    def finalize(self, pooled: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Device values that join the host transfer, by name, from the pooled (reduced) values."""
        return {}

    def facts(self, host: Mapping[str, list[float]]) -> dict[str, Any]:
        """:class:`~lightning_hookdiag.logged_values.ObservedStep` fields this component fills, from the host values."""
        return {}


Factory = Callable[[Setup], Component | None]

FACTORIES: list[Factory] = []
"""The registered factories, in registration order (the order components are driven in)."""


def component(factory: Factory) -> Factory:
    """Register ``factory`` (a decorator): every fit calls it once and drives what it returns, unless ``None``.

    Remove it again with ``FACTORIES.remove(factory)``.
    """
    FACTORIES.append(factory)
    return factory


def call_all(calls: Iterable[Callable[[], object]]) -> None:
    """Make every call, also after one raised, then raise the first error: what removes hooks must remove them all."""
    errors: list[BaseException] = []
    for call in calls:
        try:
            call()
        except BaseException as error:
            errors.append(error)
    if errors:
        raise errors[0]
