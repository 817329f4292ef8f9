"""The engine of one fit: everything one ``fit`` creates, in one object that is dropped in one place.

:class:`FitRun` owns the optimizer step: when it is observed, its window, the sentinel's check, a trip's plan and its
replay or trace, and the collected results. Nothing here knows Lightning: the callback translates the Trainer's events
into its calls, with a :class:`TrainingLoop` for what only the Trainer can do (the loss scale, whether a step can be
replayed, running a micro-batch's ``training_step``). Dropping it drops every reference to the module and the device
state, so the callback pickles after a fit, also a failed one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hookdiag._aggregation import LayerOrders, LayerStatsAggregator, agreed_orders
from lightning_hookdiag._distributed import all_reduce_max
from lightning_hookdiag._fast_path import FastPath
from lightning_hookdiag._hooks import HookSet
from lightning_hookdiag._inplace import ReplayWriteLimit
from lightning_hookdiag._logged_values import (
    Histograms,
    KeyCache,
    Note,
    ObservedStep,
    StepFacts,
    histogram_series,
    late_note,
    opt_in_note,
    parameter_facts,
    step_notes,
    step_values,
    undefined_note,
)
from lightning_hookdiag._opt_in import OptInPlan, plan_opt_in
from lightning_hookdiag._optimizer_watch import Schedule, StepWatch
from lightning_hookdiag._params import (
    P_UPDATE_SQ,
    ParameterTracker,
    named_parameters_of,
    owned_parameters,
    stale_gradient_squares,
)
from lightning_hookdiag._participation import model_picture
from lightning_hookdiag._provenance import NonFiniteTrace, nonfinite_in_batch
from lightning_hookdiag._recorder import StepRecorder
from lightning_hookdiag._rerun import MicroBatch, capture_rng, replay_step
from lightning_hookdiag._selection import excluded_names, resolve_layers
from lightning_hookdiag._sentinel import NoSentinel, Sentinel
from lightning_hookdiag._stats import accumulation_dtype
from lightning_hookdiag._step_state import StepState, Trip, plan_trip
from lightning_hookdiag._vocabulary import (
    GRADIENT_STATS,
    LAYER_STATS,
    MOMENT_STATS,
    PARAMETER_STATS,
    PER_PARAMETER_STATS,
    ZERO_IN_HEALTH,
)
from lightning_hookdiag.builtins import COMPONENTS, NO_EXTENSIONS, Extensions, every_rule
from lightning_hookdiag.components import Component, FitConfig, Parts, Setup, WindowStart, call_all
from lightning_hookdiag.rules._context import CORE_FACTS, MEMORY, Observed
from lightning_hookdiag.rules._registry import Rule, reads_any

__all__ = ["FitRun", "StepCheck", "TrainingLoop"]

Sharded = Callable[[Mapping[str, nn.Parameter]], bool]  # whether the strategy shards them over processes

# Read back every window besides the logged statistics, where present: what the notes and the rules read.
_ALWAYS_READ = ("count", "grad_count", "param_seen", "grad_norm_total", "stale_grad_sq")


class TrainingLoop(Protocol):
    """What the engine needs of the training loop at an optimizer step.

    :class:`~lightning_hookdiag._replay.LightningStep` is Lightning's.
    """

    def loss_scale(self) -> Tensor | None:
        """The ``GradScaler``'s scale the losses and gradients carry, or ``None``."""

    def replay_blocker(self) -> str | None:
        """Why the step cannot be re-run before the optimizer applies it, or ``None``."""

    def micro_batch_loss(self, micro: MicroBatch) -> Tensor | None:
        """Run ``training_step`` on ``micro`` again; the loss as the loop back-propagates it (``None``: skipped)."""

    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """Every optimizer of the fit."""

    def holds_parameters(self) -> bool:
        """Whether the optimizers step the module's own parameters (not copies of them, as DeepSpeed's do)."""

    def schedule(self, optimizer: torch.optim.Optimizer) -> Schedule:
        """How the loop steps ``optimizer``'s LR scheduler, and how often it has."""


@dataclass(frozen=True)
class StepCheck:
    """A trip of the sentinel, as the engine recorded it.

    Attributes:
        trip: The trip, with its replay's or trace's findings (replayed, reason, NaN/Inf origin, bad batch).
        observed: A window of the step is open and logs the trip with its statistics; ``False``: the trip is only
            recorded (a failure that persists is reported at its first step).
    """

    trip: Trip
    observed: bool


class FitRun:
    """The run objects of one fit, its open step and every transition of it (the module's docstring).

    The callback drives a step with :meth:`close_past`, :meth:`begin_micro_batch`, :meth:`before_backward`,
    :meth:`after_backward`, :meth:`check_step` and :meth:`end_micro_batch`; what a finished window observed comes back
    as an :class:`~lightning_hookdiag._logged_values.ObservedStep`, which :meth:`results` and :meth:`histograms` turn
    into what is logged. ``sentinel``: the fit's per-step check (the callback's, kept over fits and checkpoints).

    Raises:
        ValueError: A name of the selection matches nothing (:func:`~lightning_hookdiag._selection.resolve_layers`).
    """

    def __init__(
        self,
        config: FitConfig,
        pl_module: nn.Module,
        trainer_precision: str | int | None,
        sharded: Sharded,
        sentinel: Sentinel | None = None,
        extensions: Extensions = NO_EXTENSIONS,
    ) -> None:
        # None (no type filter) is the empty filter to resolve_layers.
        modules = resolve_layers(pl_module, config.layers, config.layer_types or (), config.exclude)
        wanted = set(config.stats)
        self.config = config
        self.model = pl_module  # where the tracked parameters are looked for when one moved
        self.layer_names = list(modules)
        self.layer_types = {name: type(m).__name__ for name, m in modules.items()}  # for the rules
        self.tracked = _tracked_parameters(config, pl_module, modules)  # by their names now (follow_names)
        params = self.tracked() if wanted & set(PARAMETER_STATS) else {}
        self.param_names, self.params = list(params), list(params.values())
        self.homes = _homes(pl_module, self.params)  # (module, attribute) of each parameter when last named
        self.sentinel_params = list(named_parameters_of(modules).values()) if config.sentinel_grads else []
        # A module of the default selection that does not run is usually unused by design (a dropout that fused
        # attention skips, MultiheadAttention's out_proj): a note, not a warning, unless it holds parameters.
        self.quiet_not_run = frozenset(
            name for name, m in modules.items() if config.layers is None and not any(True for _ in m.parameters())
        )
        device = getattr(pl_module, "device", None)
        device = device if isinstance(device, torch.device) else torch.device("cpu")
        dead_unit_layers = [i for i, m in enumerate(modules.values()) if isinstance(m, config.dead_unit_types)]
        unit_layers = frozenset(dead_unit_layers if "act_dead_frac" in wanted else ())
        self.plan: OptInPlan = plan_opt_in(config.stats, config.precision_targets, trainer_precision)
        self.aggregator = LayerStatsAggregator(
            len(modules),
            len(params),
            dtype=accumulation_dtype(device),
            sharded_params=sharded(params),
            histogram_bins=config.histogram_bins if config.histogram_every_n_steps else 0,
            unit_layers=unit_layers,
        ).to(device)
        setup = Setup(config=config, model=pl_module, modules=modules, plan=self.plan, aggregator=self.aggregator)
        made = [factory(setup) for factory in (*COMPONENTS, *extensions.components)]
        self.components: list[Component] = [c for c in made if c is not None]
        """Every configured optional part: the built-in ones, then the extensions'."""
        self.parts = Parts(self.components)  # drives them all; the hook set's one companion
        self.rules: list[Rule] = [r for r in every_rule(extensions) if r.name in config.rules]
        """The enabled rules: the facts are gathered for them."""
        _check_reads(self.rules, self.parts.provides)
        self.logged = (*self.plan.logged, *(s for s in self.parts.logged if s not in self.plan.logged))
        """Per-layer statistics beyond the default ones: the plan's, then those components declare."""
        self.fast = FastPath(config.fast_path, device, trainer_precision)
        """The one-pass reduction of large outputs, when ``MeasureConfig.fast_path`` has the fit use it."""
        self.recorder = StepRecorder(
            len(modules),
            moments=bool(wanted & set(MOMENT_STATS)),
            unit_layers=unit_layers,
            unit_dim=config.unit_dim,
            names=self.layer_names,
            stack_small=True,
            components=self.components,
            histogram_bins=config.histogram_bins if config.histogram_every_n_steps else 0,
            dtype=self.aggregator.acc_dtype,
            device=device,
            fast=self.fast.onepass,
        )
        grads = wanted & set(GRADIENT_STATS) or self.parts.wants_grads
        on_grad = self.recorder.on_grad if grads else None
        self.hooks = HookSet(modules, None, on_grad, self.recorder.on_tensor, [self.parts])
        snapshot = "param_update_ratio" in wanted
        self.tracker = ParameterTracker(params, snapshot=snapshot, dtype=self.aggregator.acc_dtype) if params else None
        self.keys = KeyCache(config.prefix, len(modules))
        self.state = StepState(config.every_n_steps)
        self.sentinel: Sentinel = sentinel if sentinel is not None else NoSentinel()
        self.watch = StepWatch()  # learning rates and applied steps of the open window, for not_updated
        self.picture = model_picture(pl_module)  # the modules it was built on (read_again)
        self._step_handles: list[RemovableHandle] = []  # the optimizers' step hooks of a sampled micro-batch
        self._stepping = False  # inside one of their steps (set by the pre hook, cleared by the post hook)

    # ------------------------------------------------------------------------------------------------ the step
    def read_again(self, step: int) -> bool:
        """Whether ``step`` is sampled, no window is open, and the model's modules are no longer those read at start.

        Then the callback builds the fit's run objects again from the model as it is now (a head replaced in the
        module's own ``on_fit_start``, which runs after the callback's): the selection, the tracked parameters and
        every component are read at the step, not only at fit start.
        """
        return self.state.window is None and self.state.sampled(step) and model_picture(self.model) != self.picture

    def fit_notes(self) -> list[Note]:
        """The one-time notes of the fit's start (opt-in statistics left out)."""
        note = opt_in_note(self.plan.note)
        return [note] if note is not None else []

    def close_past(self, step: int, last_order: Sequence[str]) -> ObservedStep | None:
        """Close what belongs to an optimizer step before ``step``: its window (returned, collected) and micro-batches.

        ``last_order``: the forward order a window of parameters only keeps (:meth:`collect`).
        """
        window = self.state.window
        observed = self.collect(last_order) if window is not None and window.step != step else None
        if self.state.micro.step is not None and self.state.micro.step != step:
            self.end_step()
        return observed

    def begin_micro_batch(
        self,
        step: int,
        batch: Any,
        batch_idx: int,
        optimizers: Sequence[torch.optim.Optimizer],
        last_metrics: Mapping[str, float],
    ) -> Note | None:
        """A micro-batch of optimizer step ``step`` starts: keep it for a replay; if the step is sampled, observe it.

        A sampled step's window opens at its first micro-batch, after ``last_metrics`` (the last logged values);
        ``optimizers``: see :meth:`attach`. Returns the note of a sampled step observed late (:func:`late_note`).
        """
        state = self.state
        if self.sentinel.keeps_batches:
            # A reference, not a copy; the RNG state is a 5 KB host copy (measured 1.5 us on the CPU).
            state.micro.keep(step, MicroBatch(batch, batch_idx, capture_rng(self.device())))
        if not state.sampled(step):
            return None
        note = None
        if state.window is None:
            self.open_window(step, last_metrics)
            note = late_note(state.late, step, self.config.every_n_steps)
        self.attach(batch, optimizers)
        return note

    def before_backward(self, loss: Tensor, n_optimizers: int) -> None:
        """Add the micro-batch's ``loss`` to the sentinel's total; end an observed step's forward."""
        self.sentinel.observe_loss(loss)
        if self.state.window is not None:  # an unsampled step pays for nothing below
            self.end_forward(loss)
            self.check_stale(n_optimizers)

    def check_step(
        self,
        step: int,
        optimizer: torch.optim.Optimizer,
        loop: TrainingLoop,
        traces: Callable[[Trip], bool],
        last_metrics: Mapping[str, float],
    ) -> StepCheck | None:
        """``optimizer`` is about to step: the sentinel's check, a trip's replay or trace, an observed step's weights.

        ``traces``: whether the rules read where a trip's NaN/Inf was made; ``last_metrics``: the last logged values
        (a replay's window opens after them). Returns the step's trip, if it tripped here.
        """
        scale = loop.loss_scale()
        checked = self._check(step, scale, loop, traces, last_metrics)
        if self.state.window is None:  # unsampled and not tripped (a trip opens a window)
            return checked
        self.end_closure()
        # Membership says nothing where the optimizers hold copies of the parameters.
        watch = reads_any("param_facts", self.rules) and loop.holds_parameters()
        self.before_optimizer_step(optimizer, loop.optimizers(), scale, watch, loop.schedule(optimizer))
        return checked

    def collect_before_update(self, last_order: Sequence[str]) -> ObservedStep:
        """End the micro-batch and collect the open window before the optimizer applies the step (:meth:`collect`).

        Finished before the update: its hooks must not see LBFGS's later closures.
        """
        self.end_micro_batch()
        return self.collect(last_order, before_update=True)

    def end_epoch(self) -> None:
        """Drop a window whose batch ended without its end (Lightning skipped the rest of the epoch): :meth:`release`.

        Hooks still attached here must not see the module's own ``on_train_epoch_end`` or anything later.
        """
        if self.hooks.attached:
            self.release()

    def end_step(self) -> None:
        """Forget the step's micro-batches and the sentinel's loss total (the step is over)."""
        try:
            self.state.micro.release()
        finally:
            self.sentinel.discard()

    def histograms(self, observed: ObservedStep) -> Histograms:
        """The step's histograms, one series per key (``observed`` has ``histogram_edges``)."""
        assert observed.histogram_edges is not None
        act, grad = observed.host["act_hist"], observed.host["grad_hist"]
        return histogram_series(act, grad, observed.histogram_edges, keys=self.keys, layer_names=self.layer_names)

    def device(self) -> torch.device:
        """The module's device now (a LightningModule's; CPU for a plain module)."""
        device = getattr(self.model, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def _check(
        self,
        step: int,
        scale: Tensor | None,
        loop: TrainingLoop,
        traces: Callable[[Trip], bool],
        last_metrics: Mapping[str, float],
    ) -> StepCheck | None:
        """The sentinel's check of ``step``; a trip is planned once and carried out (:meth:`_respond`)."""
        if not self.state.first_check(step):
            return None  # LBFGS evaluates its closure several times per step: the first evaluation is checked
        previous = self.sentinel.previous_trip
        # With a GradScaler, inf/NaN gradients are routine: the scaler skips that step and lowers its scale.
        grads = [p.grad for p in self.sentinel_params if p.grad is not None] if scale is None else []
        trip = self.sentinel.check(step, grads, scale)
        if trip is None:
            return None
        recorded = self._respond(trip, previous, traces(trip), loop, last_metrics)
        window = self.state.open_for(step)
        if window is None:  # recorded only: a failure that persists is reported at its first step
            return StepCheck(recorded, observed=False)
        window.trip = recorded
        return StepCheck(recorded, observed=True)

    def _respond(
        self, trip: Trip, previous: int | None, traces: bool, loop: TrainingLoop, last_metrics: Mapping[str, float]
    ) -> Trip:
        """Carry out :func:`~lightning_hookdiag._step_state.plan_trip`'s plan for ``trip``; returns the trip to record.

        Every plan but ``"record"`` leaves a window of the step open. ``previous``: the sentinel's trip before this one;
        ``traces``: the rules read where its NaN/Inf was made.
        """
        step, micro = trip.step, self.state.micro
        sampled = self.state.open_for(step) is not None
        blocker = loop.replay_blocker()
        plan = plan_trip(
            trip, sampled=sampled, traces=traces, blocker=blocker, previous=previous, held=micro.holds(step)
        )
        trace = NonFiniteTrace(self.model) if plan.trace or plan.action == "trace" else None
        if plan.action == "replay":  # into a new window; the hook set attaches the components that watch replays
            self.open_window(step, last_metrics)
            with self.parts.replaying():
                failure = self._rerun(loop, self.hooks, trace)
            # Every process must agree, or the pooled statistics' collectives would not match.
            if all_reduce_max(torch.tensor([float(failure is not None)], device=self.device())).item() > 0:
                self.discard_window()
                trace = None
                plan = plan.failed(failure or "the replay failed on another process")
        elif plan.action == "trace":
            # The hooks saw the step as it happened but cannot see functional code between two layers; still attached
            # (batch end removes them), they must not count the re-run through the trace alone.
            self.end_micro_batch()
            if self._rerun(loop, HookSet({}, None), trace) is not None:
                trace = None  # the finding keeps what the hooks saw
        if plan.action == "parameters":
            self.open_window(step, last_metrics, layers=False)  # the parameters can still be measured
            self.state.sample_next = step + 1
        entry, origin = trace.origin(self.layer_names) if trace is not None else (None, None)
        recorded = replace(plan.trip, nan_entry=entry, nan_origin=origin)
        if plan.read_batch:  # data that arrives non-finite (a division by a zero std) is named as such; one read
            recorded = replace(recorded, bad_batch=tuple(nonfinite_in_batch([m.batch for m in micro.batches])))
        return recorded

    def _rerun(self, loop: TrainingLoop, hooks: HookSet, trace: NonFiniteTrace | None) -> str | None:
        """Run the step's micro-batches again through ``hooks`` and ``trace``; why it raised, or ``None``."""
        try:
            replay_step(self.state.micro.batches, loop.micro_batch_loss, self.model, hooks, self.device(), trace)
        except ReplayWriteLimit as error:  # refused before the write; the writes before it were undone
            return f"{error}; the replay stopped there and undid its earlier writes"
        except Exception as error:  # reported in the finding; training goes on untouched
            return f"the replay raised {type(error).__name__}: {error}"
        return None

    # ---------------------------------------------------------------------------------------------- the parts
    def attach(self, batch: Any, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """A sampled micro-batch starts with ``batch``: attach its hooks (the hook set's and every component's).

        They record until one of ``optimizers`` has stepped, or :meth:`after_backward` outside a step; without
        ``optimizers`` (manual optimization), until :meth:`end_micro_batch` (``docs/integrations.md``).
        """
        self.parts.observe_batch(batch)
        self.hooks.attach()  # and the components (its companion)
        self._stepping = False
        for optimizer in optimizers:
            self._step_handles.append(optimizer.register_step_pre_hook(self._step_starts))
            self._step_handles.append(optimizer.register_step_post_hook(self._step_ends))

    def _step_starts(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A closure evaluated from here on (LBFGS evaluates several) is the micro-batch's own.
        self._stepping = True

    def _step_ends(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The step is over: a forward after it is not training's (another callback's on_train_batch_end). The
        # optimizer's handles stay until the batch ends: removing them here would change the dict torch iterates.
        self._stepping = False
        self.stop_recording()

    def after_backward(self) -> None:
        """A micro-batch's backward is over: recording ends, unless an optimizer step (which may run it again) is on."""
        if self._step_handles and not self._stepping:
            self.stop_recording()

    def end_forward(self, loss: Tensor | None = None) -> None:
        """The micro-batch's forward is over (``loss``: what is back-propagated); forward watchers leave."""
        self.parts.end_forward(loss)

    def stop_recording(self) -> None:
        """Remove the micro-batch's hooks, all of them also after an error; the components keep what they measured."""
        if self.hooks.attached:  # a sampled micro-batch (an unsampled step pays for nothing below)
            self.hooks.remove(finished=True)

    def end_micro_batch(self) -> None:
        """The micro-batch is over: :meth:`stop_recording`; remove the optimizers' step hooks, even after an error."""
        call_all([self.stop_recording, self._remove_step_handles])

    def _remove_step_handles(self) -> None:
        handles, self._step_handles = self._step_handles, []
        for handle in handles:
            handle.remove()

    def end_closure(self) -> None:
        """An optimizer closure's forward and backward are over; the hooks stay attached for the next one.

        Each LBFGS evaluation saves for its own backward: the saved bytes are measured per evaluation, not summed.
        """
        if self.hooks.attached:
            self.hooks.end_micro_batch()

    def detach(self) -> None:
        """Remove every hook, also after an error; an interrupted micro-batch's measurements are dropped. Idempotent."""
        call_all([self.hooks.remove, self._remove_step_handles])

    def open_window(self, step: int, last_metrics: Mapping[str, float], layers: bool = True) -> None:
        """Open the window of ``step`` (``layers=False``: parameters only) after ``last_metrics``, the last logged."""
        self.state.open(step, layers)
        self.follow_names()
        every = self.config.histogram_every_n_steps
        # Replays follow the schedule of sampled steps; parameter-only windows have no histograms.
        self.recorder.histograms = layers and every is not None and self.state.due(step, every)

        def previous(stat: str) -> list[float]:
            return [last_metrics.get(key, 0.0) for key in self.keys.keys(stat, self.layer_names)]

        self.parts.reset(WindowStart(self.aggregator.act_moments.device, previous))

    def follow_names(self) -> None:
        """Name each tracked parameter as its module names it now, after a reparametrisation (docs/statistics.md#names).

        Each parameter is looked up where it was; the names are derived again from the model only when one moved.
        """
        held = zip(self.homes, self.params, strict=True)
        if all(attr in module._parameters and module._parameters[attr] is p for (module, attr), p in held):
            return
        now = {id(p): name for name, p in self.tracked().items()}
        self.param_names = [now.get(id(p), name) for p, name in zip(self.params, self.param_names, strict=True)]
        self.homes = _homes(self.model, self.params)

    def discard_window(self) -> None:
        """Drop the open window, if any: nothing of it is logged, and what it leaves behind is reset for the next."""
        self.state.close()
        if self.tracker is not None:
            self.tracker.release()  # the snapshot of a window closed before its update
        self.hooks.clear_order()
        self.recorder.release()
        self.aggregator.reset()
        self.aggregator.grad_scale = None
        self.watch.release()

    def check_stale(self, n_optimizers: int) -> None:
        """At the open window's first backward, measure the gradients held from the previous step (``stale_gradients``).

        None are held with ``zero_grad``: then this costs no kernel.
        """
        window = self.state.window
        if window is None or window.stale_checked or n_optimizers != 1:
            return
        window.stale_checked = True
        window.stale = stale_gradient_squares(self.params, self.aggregator.acc_dtype)

    def before_optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizers: Sequence[torch.optim.Optimizer],
        scale: Tensor | None,
        watch_membership: bool,
        schedule: Schedule = (None, None, None, None),
    ) -> None:
        """Measure the weights and gradients before ``optimizer`` steps (a step's first call: docs/integrations.md).

        ``scale``: the ``GradScaler``'s, which the tensor hooks saw gradients scaled by. ``watch_membership``: watch
        learning rates and membership for ``not_updated`` (not where the optimizers hold copies of the parameters, as
        DeepSpeed's do). ``schedule``: how Lightning steps ``optimizer``'s LR scheduler and how often it has.
        """
        window = self.state.window
        if window is None:
            return
        first = not window.stepped
        if not window.first_call(optimizer):
            return
        if scale is not None:
            # The scale may change in scaler.update() after this step.
            self.aggregator.grad_scale = scale.detach().clone()
        if self.tracker is None:
            return
        groups = optimizer.param_groups
        if watch_membership:
            self.watch.observe(optimizer, schedule)
            unheld = self.watch.unheld(self.tracker.params, optimizers) if first else []
            groups = [*groups, {"params": unheld}] if unheld else groups  # measured like the stepped ones
        measured = self.tracker.before_step(groups)
        if measured is not None:
            self.aggregator.update(params=(measured[0], measured[1], slice(None)))

    def results(self, observed: ObservedStep) -> tuple[dict[str, float], Observed, list[Note]]:
        """The step's logged metrics, the step as the rules read it and its one-time notes (``step_values``, ...)."""
        metrics, values = step_values(
            observed,
            keys=self.keys,
            layer_names=self.layer_names,
            param_names=self.param_names,
            # NaN: not a ReLU-family layer (act_dead_frac); undefined for this output (an opt-in statistic of an
            # all-zero or constant output).
            undefined_skipped={"act_dead_frac", *self.logged},
            total="grad_norm_total" in self.config.stats,
            zero_quiet=ZERO_IN_HEALTH if self.config.charts == "default" else (),
        )
        default = self.config.layers is None
        notes = step_notes(observed, self.layer_names, default_selection=default, quiet_not_run=self.quiet_not_run)
        undefined = undefined_note(observed, self.param_names)
        facts = {
            **observed.facts,
            "forward_order": observed.forward_order,
            "backward_order": observed.backward_order,
            "trip": observed.trip,
            "layer_types": self.layer_types,
        }
        return (
            metrics,
            Observed(observed.step, values, facts),
            [*notes, *([undefined] if undefined is not None else []), *self.fast.notes()],
        )

    def collect(self, last_order: Sequence[str] = (), before_update: bool = False) -> ObservedStep:
        """Close the open window: pool it, reduce it over processes and read it back in one host transfer.

        Every process takes part in the reduction, also one whose layers did not run. ``last_order``: the forward order
        a window of parameters only keeps for the rules (the last observed one). ``before_update``: the optimizer has
        not stepped (``on_anomaly="raise"`` on a trip): there is no update to measure.
        """
        window = self.state.close()
        assert window is not None, "collect() needs an open window"
        agg, recorder, hooks = self.aggregator, self.recorder, self.hooks
        updated = None if self.tracker is None or before_update else self.tracker.after_step()
        self.parts.fold()
        # The recorder's rows of the step, handed down: one update per window.
        agg.update(recorder.take(), params=None if updated is None else (updated[0], updated[1], P_UPDATE_SQ))
        own = LayerOrders(hooks.fired_order, hooks.grad_order, hooks.missing_grad_layers())
        agg.agree_orders(own)  # every process must hold the same orders, so the same depths and findings
        values = agg.pooled()  # reduced over processes: one SUM and one MAX all-reduce (aggregation.py)
        if window.stale is not None:
            values["stale_grad_sq"] = window.stale.to(values["count"].device)
        default = (*LAYER_STATS, *PER_PARAMETER_STATS) if window.layers else PER_PARAMETER_STATS
        wanted = [s for s in default if s in self.config.stats and not (before_update and s == "param_update_ratio")]
        wanted += self.logged if window.layers else ()
        names = [*wanted, *(name for name in _ALWAYS_READ if name in values)]
        # The weight norm tells an undefined update ratio (weights all 0) from a non-finite one.
        if "param_update_ratio" in wanted and "param_norm" not in wanted and "param_norm" in values:
            names.append("param_norm")
        if "param_norm" in wanted and "param_norm_min" in values:  # replicated parameters of a distributed run
            names.append("param_norm_min")
        if recorder.histograms:
            names += ["act_hist", "grad_hist"]
        if "layer_orders" in values:  # agreed over processes
            names.append("layer_orders")
        finalized = self.parts.finalize(values)
        values.update(finalized)
        # An opt-in statistic is read back only where it is logged (not in a parameter-only window).
        names += [name for name in finalized if name not in names and name not in self.logged]
        parts = [values[name].reshape(-1).to(torch.float64) for name in names]
        flat = iter(torch.cat(parts).tolist())  # the one host transfer
        host = {name: list(itertools.islice(flat, part.numel())) for name, part in zip(names, parts, strict=True)}
        orders = agreed_orders(host.pop("layer_orders"), len(self.layer_names)) if "layer_orders" in host else own
        if window.layers and "act_mean" in values:  # the next windows' shifts; the first pooled one warms
            self.fast.pooled(recorder, values["act_mean"], host["count"], self.device())
        param_facts = self.watch.facts(self.param_names, self.tracker.params) if self.tracker is not None else {}
        observed = ObservedStep(
            step=window.step,
            layers=window.layers,
            trip=window.trip,
            host=host,
            wanted=wanted,
            unobserved=StepFacts(
                unit_mismatch=frozenset(agg.unit_mismatch),
                no_float=frozenset(recorder.no_float_output),
                sparse=frozenset(recorder.sparse_output),
                empty=frozenset(recorder.empty_output),
                nested=frozenset(recorder.nested_output),
                opaque=frozenset(recorder.opaque_output.items()),
            ),
            forward_order=[hooks.names[i] for i in orders.forward] if window.layers else list(last_order),
            backward_order=[hooks.names[i] for i in orders.backward],
            facts={
                # The whole window's, replays included (rule no_gradient); missed on any process.
                "missing_grads": [hooks.names[i] for i in orders.missing_grads],
                "param_facts": param_facts,
                **parameter_facts(host, self.param_names),
                **self.parts.facts(host),
            },
            histogram_edges=recorder.histogram_edges_host if recorder.histograms else None,
        )
        self.discard_window()  # the window is closed and read: this resets what it leaves behind
        return observed

    def release(self) -> None:
        """Remove every hook, drop the open window (not logged) and :meth:`end_step` (the fit is over, or the step)."""
        try:
            self.detach()
        finally:  # also when a component's remove raised: the window and the micro-batches go all the same
            try:
                self.discard_window()
            finally:
                self.end_step()


def _check_reads(rules: Sequence[Rule], provided: frozenset[str]) -> None:
    """Raise for a fact an enabled rule reads that neither the engine nor a component gathers (a misspelt name)."""
    known = CORE_FACTS | MEMORY | provided
    for r in rules:
        if unknown := sorted({*r.reads, *r.uses} - known):
            raise ValueError(f"rule {r.name!r}: reads={unknown} names no fact of the step; facts: {sorted(known)}")


def _homes(root: nn.Module, params: Sequence[nn.Parameter]) -> list[tuple[nn.Module, str]]:
    found: dict[int, tuple[nn.Module, str]] = {}
    for module in root.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                found.setdefault(id(p), (module, attr))
    # A parameter no longer in the model keeps its name; an empty home never holds it, so it is looked up each time.
    return [found.get(id(p), (root, "")) for p in params]


def _tracked_parameters(
    config: FitConfig, pl_module: nn.Module, modules: Mapping[str, nn.Module]
) -> Callable[[], dict[str, nn.Parameter]]:
    """The parameters the statistics track, by logged name, as the modules name them when called."""
    # The default selection counts every parameter (also those of non-leaf modules, such as a ViT's cls_token), so
    # grad_norm_total is the norm that clip_grad_norm_ sees; a selection narrows it.
    if config.layers is None and not config.layer_types:
        skip = excluded_names(pl_module, config.exclude)  # module names, resolved once
        return lambda: owned_parameters(pl_module, skip=skip)
    selected = dict(modules)
    return lambda: named_parameters_of(selected)
