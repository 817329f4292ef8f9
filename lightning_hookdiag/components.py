"""The one extension interface of a fit: every optional part is a :class:`Component`.

:class:`~lightning_hookdiag._fit_run.FitRun` builds each from a factory marked with :func:`component` (``None``: not
configured): the built-in ones listed in :mod:`lightning_hookdiag.builtins`, then those passed in the callback's
``extensions=``. One :class:`Parts` drives every one through the same calls, in training and in a replay alike, in
this order within a window:

``reset`` (a window opens) → per micro-batch ``observe_batch``, ``attach``, ``on_output`` / ``on_grad`` (per hooked
tensor), ``end_forward``, ``end_micro_batch``, ``remove`` → ``fold`` (pool into the aggregator's states) →
``finalize`` (pooled device values that join the one host transfer) → ``facts`` (the step's facts for the rules, by
name: :class:`~lightning_hookdiag.rules.Observed`).

A component that pools declares its states in its factory
(:meth:`~lightning_hookdiag._aggregation.LayerStatsAggregator.add_state`) and adds into them with
:meth:`~lightning_hookdiag._aggregation.LayerStatsAggregator.pool`; they ride in the core states' two packed
all-reduces. Every method defaults to doing nothing, and the recorder hands tensors only to components that define
``on_output`` / ``on_grad``: the default path pays nothing.

Example:
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

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, SupportsIndex

import torch
from torch import Tensor, nn

from lightning_hookdiag.rules._registry import named_object

if TYPE_CHECKING:
    from lightning_hookdiag._aggregation import LayerStatsAggregator

__all__ = [
    "Component",
    "ComponentFactory",
    "FitConfig",
    "Parts",
    "Setup",
    "WindowStart",
    "call_all",
    "component",
    "module_hook",
]

TensorSink = Callable[[int, Tensor], None]


@dataclass(frozen=True)
class FitConfig:
    """What a fit's run objects need of the callback's configuration.

    Each field is the callback's argument of its name, validated and resolved (``stats=`` with ``extra_stats=``; see
    :class:`~lightning_hookdiag.LayerHealthCallback`), except those derived from ``sentinel=`` and ``rules=``:

    Attributes:
        sentinel_grads: The sentinel also checks the selected parameters' gradients (``"loss+grads"``).
        rules: The enabled rules; a component that feeds one rule only is built when that rule is enabled.
        fast_path: ``MeasureConfig.fast_path``.
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
    fast_path: str = "auto"


@dataclass(frozen=True)
class Setup:
    """What a factory may read when a fit starts.

    Attributes:
        config: The callback's configuration (:class:`FitConfig`).
        model: The LightningModule.
        modules: The selected ``{name: module}``; layer indices refer to this order.
        plan: The :class:`~lightning_hookdiag._opt_in.OptInPlan` of the fit (``Any``: ``opt_in`` imports this module).
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
    provides: ClassVar[tuple[str, ...]] = ()
    """The names of the facts :meth:`facts` returns: what a rule's ``reads`` may name besides the engine's."""
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
        """The step's facts this component gathers, by the names in :attr:`provides`, from the host values.

        A rule reads them by name (``ctx.fact(name)``, or ``ctx.stat(name)`` for a per-name number it does not log).
        """
        return {}


class Parts:
    """Drives a fit's components through the whole protocol: the one place each call is made, replays included.

    The hook set holds it as its one companion, so it attaches, ends micro-batches and removes with the hook set's
    own hooks; :meth:`replaying` narrows those three calls to the components that watch replays (:attr:`replays`)
    while a tripped step is replayed. Calls that remove hooks are made on every component, also after one raised.

    Args:
        components: The fit's components, in the order of their factories.
    """

    def __init__(self, components: Sequence[Component]) -> None:
        self.all = tuple(components)
        # Those that watch replays attach first: the order the hook set and the run attached them in before.
        self._training = (*(c for c in self.all if c.replays), *(c for c in self.all if not c.replays))
        self._replaying = tuple(c for c in self.all if c.replays)
        self._live = self._training

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Within the block, attach, end and remove only the components that watch replays."""
        self._live = self._replaying
        try:
            yield
        finally:
            self._live = self._training

    @property
    def logged(self) -> tuple[str, ...]:
        """The per-layer statistics the components declare (:attr:`Component.logged`), each once."""
        return tuple(dict.fromkeys(s for c in self.all for s in c.logged))

    @property
    def provides(self) -> frozenset[str]:
        """The names of the facts the components gather (:attr:`Component.provides`)."""
        return frozenset(name for c in self.all for name in c.provides)

    @property
    def wants_grads(self) -> bool:
        """Whether a component takes output gradients (the hook set then hooks them)."""
        return any(c.on_grad is not None for c in self.all)

    def reset(self, window: WindowStart) -> None:
        """A window opens."""
        for c in self.all:
            c.reset(window)

    def observe_batch(self, batch: Any) -> None:
        """A sampled training micro-batch starts with ``batch``."""
        for c in self.all:
            c.observe_batch(batch)

    def attach(self) -> None:
        """Attach the live components (after the hook set's hooks)."""
        for c in self._live:
            c.attach()

    def end_forward(self, loss: Tensor | None) -> None:
        """The micro-batch's forward is over."""
        for c in self.all:
            c.end_forward(loss)

    def end_micro_batch(self) -> None:
        """The micro-batch (or an optimizer closure) ran to its end: the live components keep what it measured."""
        call_all([c.end_micro_batch for c in self._live])

    def remove(self) -> None:
        """Remove the live components' hooks, all also after an error; an unfinished measurement is dropped."""
        call_all([c.remove for c in self._live])

    def fold(self) -> None:
        """Pool this process's window into the registered states."""
        for c in self.all:
            c.fold()

    def finalize(self, pooled: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Every component's device values, by name."""
        return {k: v for c in self.all for k, v in c.finalize(pooled).items()}

    def facts(self, host: Mapping[str, list[float]]) -> dict[str, Any]:
        """Every component's facts of the step, by name."""
        return {k: v for c in self.all for k, v in c.facts(host).items()}


Factory = Callable[[Setup], Component | None]


@dataclass(frozen=True)
class ComponentFactory:
    """A factory marked with :func:`component`: each fit calls it once with its :class:`Setup` and drives the result.

    Attributes:
        make: Returns the fit's component, or ``None`` when the fit's configuration does not ask for it.
    """

    make: Factory

    def __call__(self, setup: Setup) -> Component | None:
        """The fit's component, or ``None``."""
        return self.make(setup)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickle a factory made with ``@component`` by where it lives.

        Its module attribute is this object, not the function, so pickle could not find the function by its name: a
        callback holding such an extension (a deep copy, a checkpointed Trainer, DDP spawn) could not be pickled.
        """
        module, qualname = getattr(self.make, "__module__", None), getattr(self.make, "__qualname__", None)
        if module is not None and qualname is not None and named_object(module, qualname) is self:
            return (named_object, (module, qualname))
        return super().__reduce_ex__(protocol)


def component(factory: Factory) -> ComponentFactory:
    """Mark ``factory`` as a component factory (a decorator); it registers nothing.

    The built-in factories are listed in :mod:`lightning_hookdiag.builtins`; a user's is passed to the callback in
    ``extensions=`` and runs in that callback's fits only.
    """
    if not callable(factory):
        raise TypeError(f"component: expected a factory (a callable taking a Setup), got {factory!r}")
    return ComponentFactory(factory)


def module_hook(method: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``method`` with ``args`` first, as a plain function to register on a user's module.

    A module's hooks live in its ``__dict__``, so ``copy.deepcopy(module)`` (a user's EMA copy or snapshot in
    ``training_step``, during a sampled step) copies them: a bound method or a ``functools.partial`` would be
    deep-copied with the object behind it, and with any tensor that object holds (an output with its autograd graph,
    which cannot be copied). A function is copied by reference.

    Example:
        >>> import copy
        >>> from torch import nn
        >>> seen = []
        >>> net = nn.Linear(2, 2)
        >>> _ = net.register_forward_hook(module_hook(lambda tag, module, args, out: seen.append(tag), "fc"))
        >>> _ = copy.deepcopy(net)(torch.ones(2))
        >>> seen
        ['fc']
    """

    def hook(*hook_args: Any) -> Any:
        return method(*args, *hook_args)

    hook.__wrapped__ = method  # type: ignore[attr-defined]  # as functools.wraps sets it: what the hook calls
    return hook


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
