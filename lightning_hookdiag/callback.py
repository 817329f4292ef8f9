"""``LayerHealthCallback``: when to observe, and where the results go. The only module that knows Lightning."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from typing_extensions import override

from lightning_hookdiag.aggregation import LayerStatsAggregator
from lightning_hookdiag.attention import PrecursorProbes, attention_scope
from lightning_hookdiag.errors import LayerHealthError, LayerHealthWarning
from lightning_hookdiag.hooks import HookSet
from lightning_hookdiag.modes import EvalModeWatch
from lightning_hookdiag.opt_in import OptInPlan, OptInRecorder, plan_opt_in
from lightning_hookdiag.params import (
    P_UPDATE_SQ,
    ParameterTracker,
    named_parameters_of,
    owned_parameters,
    stale_gradient_squares,
)
from lightning_hookdiag.precision import resolve_targets
from lightning_hookdiag.provenance import NonFiniteTrace
from lightning_hookdiag.recorder import StepRecorder
from lightning_hookdiag.rules import (
    AlertState,
    Baseline,
    Finding,
    ParamFacts,
    RuleConfig,
    evaluate,
    format_error,
    values_from_metrics,
)
from lightning_hookdiag.saved_memory import SavedMemoryTracker
from lightning_hookdiag.selection import excluded_names, import_types, named_modules, resolve_layers, unmatched_error
from lightning_hookdiag.sentinel import (
    SENTINEL_MODES,
    LossSentinel,
    MicroBatch,
    SpikeDetector,
    Trip,
    all_reduce_max,
    capture_rng,
    replay_step,
)
from lightning_hookdiag.stats import accumulation_dtype, resolve_stats
from lightning_hookdiag.table import format_step_table
from lightning_hookdiag.trends import History
from lightning_hookdiag.updates import StepWatch
from lightning_hookdiag.validation import boolean, check, choice, integer, module_names
from lightning_hookdiag.vocabulary import (
    GRADIENT_STATS,
    LAYER_STATS,
    MOMENT_STATS,
    OUTPUT_LAYER_STATS,
    PARAMETER_STATS,
    PER_PARAMETER_STATS,
    PRECURSOR_STATS,
    counted_by_gradient,
)

__all__ = ["LayerHealthCallback"]

ON_ANOMALY = ("warn", "raise", "stop", "ignore")


HistogramWriter = Callable[[str, list[float], list[float], list[float], int], None]


def _histogram_writer(logger: Logger) -> HistogramWriter | None:
    """A function writing one histogram to ``logger``, or ``None`` if the logger cannot store histograms.

    The logger's own ``prefix`` applies to histogram keys as it does to scalars: W&B histograms go through
    ``log_metrics``; TensorBoard's ``log_metrics`` takes scalars only, so its key is prefixed by the same Lightning
    function that ``log_metrics`` uses.
    """
    if isinstance(logger, TensorBoardLogger):

        def tensorboard(tag: str, counts: list[float], left: list[float], right: list[float], step: int) -> None:
            filled = [i for i, c in enumerate(counts) if c > 0]
            centres = [(left[i] + right[i]) / 2 for i in range(len(counts))]
            (key,) = _add_prefix({tag: 0.0}, getattr(logger, "_prefix", ""), logger.LOGGER_JOIN_CHAR)
            logger.experiment.add_histogram_raw(
                key,
                min=left[filled[0]],
                max=right[filled[-1]],
                num=sum(counts),
                sum=sum(c * m for c, m in zip(counts, centres, strict=True)),
                sum_squares=sum(c * m * m for c, m in zip(counts, centres, strict=True)),
                bucket_limits=right,
                bucket_counts=counts,
                global_step=step,
            )

        return tensorboard
    if isinstance(logger, WandbLogger):

        def wandb_histogram(tag: str, counts: list[float], left: list[float], right: list[float], step: int) -> None:
            import wandb

            histogram = wandb.Histogram(np_histogram=(counts, [left[0], *right]))
            logger.log_metrics({tag: histogram}, step=step)  # type: ignore[dict-item]

        return wandb_histogram
    return None


def _sharded(trainer: pl.Trainer, params: dict[str, nn.Parameter]) -> bool:
    """Whether each process holds only a shard of the parameters (FSDP, FSDP2 / ModelParallel, DTensor).

    Sharded parameters' local sums of squares add up across processes; replicated ones (DDP) must not be added.
    """
    if any(callable(getattr(p, "to_local", None)) for p in params.values()):
        return True
    return isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))


def _ignore_output(layer: int, output: Any) -> None:
    return None


@contextmanager
def _logging_silenced(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` record nothing inside the block (a replayed ``training_step``)."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    # Instance attributes shadow the methods; deleting them brings the methods back.
    pl_module.__dict__["log"] = ignore
    pl_module.__dict__["log_dict"] = ignore
    try:
        yield
    finally:
        del pl_module.__dict__["log"]
        del pl_module.__dict__["log_dict"]


class LayerHealthCallback(Callback):
    r"""Log per-layer activation and gradient health on a fixed interval of optimizer steps.

    Optimizer step ``k`` is the step that starts with ``trainer.global_step == k``; it is *sampled* when
    ``k % every_n_steps == 0``. On a sampled step, hooks are attached to the selected modules at the start of each
    of its micro-batches and removed at the end of each; everything observed is pooled exactly (over calls,
    micro-batches and processes) and, once the optimizer has stepped, logged once to every logger of the Trainer
    with ``step=k``. The same values are kept in :attr:`last_metrics`, also without a logger. Hooks never exist
    outside a sampled training batch: not during validation or sanity checking, not after ``fit``, not after an
    exception. Training is bit-identical with and without the callback.

    Every key is ``<prefix>/<stat>/<layer>`` (parameter statistics: ``<prefix>/<stat>/<param>``, with the
    parameter's dotted name; ``grad_norm_total`` has no name part), logged with ``step=k``; the default and opt-in
    statistics, their definitions and the histograms are in ``docs/statistics.md``. The always-on sentinel and its
    replay of a tripped step are in ``docs/sentinel.md``, the rules in ``docs/rules.md``.

    Args:
        every_n_steps: Sample optimizer steps ``0, n, 2n, ...``.
        layers: Dotted module names or fnmatch globs (``*`` also crosses dots), relative to the LightningModule,
            as listed by :func:`~lightning_hookdiag.list_layers`. ``None`` selects every leaf module and every
            module that computes with parameters it owns, such as ``nn.MultiheadAttention``, except loss modules
            and torchmetrics metrics (or, with ``layer_types``, every module of those types), and tracks every
            parameter of the LightningModule.
        layer_types: Keep only instances of these classes, given as classes or import strings such as
            ``"torch.nn.Linear"``.
        exclude: Globs of module names to leave out.
        stats: Names of the statistics to compute and log; ``None`` for the default set
            (:data:`~lightning_hookdiag.ALL_STATS`). Work for statistics not asked for is skipped (e.g. without
            ``"param_update_ratio"`` no weight copy is made). The names of
            :data:`~lightning_hookdiag.OPT_IN_STATS` are computed only when listed here.
        prefix: First segment of every logged key.
        dead_unit_types: Module classes (or import strings) whose outputs get ``act_dead_frac``.
        unit_dim: Axis of the output that indexes units for ``act_dead_frac``. ``None``: dim 1 (channels) for
            4-D/5-D outputs, the last dim for 1-D to 3-D outputs.
        on_anomaly: What to do when a health rule fires on a sampled step (see :mod:`lightning_hookdiag.rules`):
            ``"warn"`` (a :class:`~lightning_hookdiag.LayerHealthWarning` naming the rule and the layer, once per rule
            and layer until it clears), ``"raise"`` (:class:`~lightning_hookdiag.LayerHealthError` naming the origin
            of the earliest problem), ``"stop"`` (warn, then stop training gracefully) or ``"ignore"`` (findings are
            still recorded in :attr:`findings`).
        rules: Rule settings, e.g. ``{"dead_frac_threshold": 0.5, "enabled": ["nonfinite", "dead_units"]}``; keys
            are the fields of :class:`~lightning_hookdiag.rules.RuleConfig`.
        summary: At the end of fit, print (rank zero) a table of the last sampled step's values per layer in depth
            order, with the rules that fired marked.
        histogram_every_n_steps: Also log histograms of every selected layer's output and output gradient
            (``<prefix>/act_hist/<layer>``, ``<prefix>/act_grad_hist/<layer>``) on steps divisible by this, to the
            loggers that support histograms (TensorBoard, W&B); other loggers are skipped with a one-time note.
            Must be a multiple of ``every_n_steps``. ``None`` (default): no histograms.
        histogram_bins: Number of fixed, symmetric log-spaced bins (``±1e-6`` to ``±1e4`` and 0), computed on the
            device; fixed edges make histograms pool exactly over micro-batches and processes.
        sentinel: What is checked on *every* optimizer step, sampled or not (``docs/sentinel.md``): ``"loss"``
            (default; every micro-batch's loss, for NaN/Inf and for a spike over a robust baseline of recent steps),
            ``"loss+grads"`` (also NaN/Inf in the selected parameters' gradients, before the optimizer step) or
            ``None`` (only sampled steps are observed). A step that trips is replayed with hooks before the
            optimizer applies it, without side effects on training, and logged and diagnosed at ``step=k`` like a
            sampled step; where it cannot be replayed, the finding says why and the next step is sampled.
        precision_targets: Target dtypes of the precision headroom statistics (``act_underflow_frac`` and
            friends in ``stats=``): names from ``"float16"``, ``"bfloat16"``, ``"float8_e4m3fn"``,
            ``"float8_e5m2"`` or the torch dtypes. ``None`` derives one from the Trainer's ``precision``
            (``16-mixed``/``16-true``: float16, ``bf16-mixed``/``bf16-true``: bfloat16); with full precision
            nothing is computed unless targets are named here (to plan a switch to lower precision).
        output_layer: The module whose output is the model's logits, for ``logit_lse_mean`` / ``logit_absmax``
            (a dotted name as :func:`~lightning_hookdiag.list_layers` prints it). ``None``: the last selected module
            to run in each micro-batch's forward. Naming one without either statistic in ``stats=`` is an error.

    Raises:
        ValueError: At construction, for any invalid argument (the message names it and the valid values); when
            fit starts, for a name, glob or type that matches no module (with the closest names).

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> callback = LayerHealthCallback(every_n_steps=2, stats=["act_mean", "act_std"])
        >>> trainer = pl.Trainer(max_steps=3, callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, enable_checkpointing=False)
        >>> trainer.fit(BoringModel())
        >>> sorted(callback.last_metrics)
        ['layer_health/act_mean/layer', 'layer_health/act_std/layer', 'layer_health/depth/layer']
        >>> callback.last_step
        2
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        layers: Sequence[str] | None = None,
        layer_types: Sequence[str | type[nn.Module]] | None = None,
        exclude: Sequence[str] = (),
        stats: Sequence[str] | None = None,
        prefix: str = "layer_health",
        dead_unit_types: Sequence[str | type[nn.Module]] = ("torch.nn.ReLU", "torch.nn.ReLU6"),
        unit_dim: int | None = None,
        on_anomaly: Literal["warn", "raise", "stop", "ignore"] = "warn",
        rules: dict[str, Any] | None = None,
        summary: bool = True,
        histogram_every_n_steps: int | None = None,
        histogram_bins: int = 64,
        sentinel: Literal["loss", "loss+grads"] | None = "loss",
        precision_targets: str | torch.dtype | Sequence[str | torch.dtype] | None = None,
        output_layer: str | None = None,
    ) -> None:
        self.every_n_steps: int = integer("every_n_steps", every_n_steps, "an integer >= 1", lambda v: v >= 1)
        self.prefix: str = check(
            "prefix",
            prefix,
            "a non-empty key segment without leading/trailing '/'",
            lambda p: isinstance(p, str) and bool(p.strip("/")) and p == p.strip("/"),
        )
        self.unit_dim: int | None = integer("unit_dim", unit_dim, "an integer axis or None", optional=True)
        self.summary = boolean("summary", summary)
        self.on_anomaly = choice("on_anomaly", on_anomaly, ON_ANOMALY)
        self.sentinel = choice("sentinel", sentinel, [*SENTINEL_MODES, None])
        self.output_layer = check(
            "output_layer",
            output_layer,
            "None or a non-empty module name",
            lambda o: o is None or (isinstance(o, str) and bool(o)),
        )
        self.histogram_every_n_steps: int | None = integer(
            "histogram_every_n_steps",
            histogram_every_n_steps,
            f"None or a positive multiple of every_n_steps={every_n_steps}",
            lambda v: v >= 1 and v % every_n_steps == 0,
            optional=True,
        )
        self.histogram_bins: int = integer(
            "histogram_bins", histogram_bins, "an even integer >= 4", lambda v: v >= 4 and v % 2 == 0
        )
        self.rule_config = RuleConfig.from_mapping(rules)
        self.layers = module_names("layers", layers)
        self.layer_types = import_types(layer_types, "layer_types")
        self.exclude = module_names("exclude", exclude) or []
        self.stats = resolve_stats(stats)
        if output_layer is not None and not set(OUTPUT_LAYER_STATS) & set(self.stats):
            raise ValueError(
                f"output_layer={output_layer!r} names the layer of logit_lse_mean / logit_absmax, but stats= includes"
                " neither; add them to stats= or leave output_layer=None"
            )
        self.precision_targets = resolve_targets(precision_targets)
        self.dead_unit_types = import_types(dead_unit_types, "dead_unit_types")
        config = self.rule_config
        # Created here, not when fit starts: a checkpoint's baseline is loaded before on_fit_start runs.
        self._sentinel = (
            LossSentinel(
                sentinel,
                SpikeDetector(config.spike_window, config.spike_warmup, config.spike_zscore, config.spike_ratio),
            )
            if sentinel is not None
            else None
        )

        self.last_metrics: dict[str, float] = {}
        """The values logged on the most recent sampled step (pooled over processes, on every process)."""
        self.last_step: int | None = None
        """The optimizer step :attr:`last_metrics` describes."""
        self.layer_names: list[str] = []
        """Names of the observed modules, in selection order (set when fit starts)."""
        self.execution_order: list[str] = []
        """Names of the modules in the order their forward first ran on the last sampled step."""
        self.findings: list[Finding] = []
        """Every finding that alerted (first appearance of a rule on a layer, or its return after clearing)."""
        self.last_findings: list[Finding] = []
        """All findings of the most recent sampled step, earliest origin first."""
        self.trips: list[Trip] = []
        """Every optimizer step the sentinel tripped on, with whether it was replayed and, if not, why."""
        self._alerts = AlertState()
        self._layer_types: dict[str, str] = {}
        self._warned: set[str] = set()
        self._key_cache: dict[str, list[str]] = {}
        self._hooks: HookSet | None = None
        self._recorder: StepRecorder | None = None
        self._aggregator: LayerStatsAggregator | None = None
        self._tracker: ParameterTracker | None = None
        self._param_names: list[str] = []
        self._quiet_not_run: set[str] = set()
        self._window: int | None = None
        self._window_layers = True  # False: a trip that could not be replayed; only parameters are measured
        self._trip: Trip | None = None  # the trip of the open window
        self._micro: list[MicroBatch] = []  # this optimizer step's micro-batches, kept for a replay
        self._micro_step: int | None = None
        self._checked_step: int | None = None
        self._sample_next: int | None = None
        self._sentinel_params: list[nn.Parameter] = []
        self._baseline: Baseline | None = None
        self._last_finite: dict[str, int] = {}
        self._stepped: set[int] = set()  # optimizers already measured in the open window (LBFGS: one per closure)
        self._logger_error: BaseException | None = None
        self._opt_in = OptInPlan()
        self._saved: SavedMemoryTracker | None = None
        self._modes: EvalModeWatch | None = None  # rule eval_mode
        self._stale_step: int | None = None
        self._params: list[nn.Parameter] = []  # the tracked parameters, in _param_names order
        self._stale: Tensor | None = None  # gradients held at the open window's first backward (stale_gradients)
        self._watch = StepWatch()  # learning rates and applied steps of the open window, for not_updated
        self._probes: PrecursorProbes | None = None
        self._history = History(4 * self.rule_config.trend_window)  # logit_drift looks back this far

    @property
    @override
    def state_key(self) -> str:
        """Identify this callback's state in a checkpoint by its selection and interval."""
        return self._generate_state_key(
            every_n_steps=self.every_n_steps, layers=self.layers, exclude=self.exclude, prefix=self.prefix
        )

    # ----------------------------------------------------------------------------------------------- lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A new fit starts from a fresh loss baseline and trend history (a checkpoint restores its own afterwards)."""
        if stage == "fit":
            if self._sentinel is not None:
                self._sentinel.reset()
            self._baseline = None
            self._last_finite = {}
            self._history = History(4 * self.rule_config.trend_window)  # the trend rules compare within one fit

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve the selection (errors for names that match nothing) and allocate the device state."""
        modules = resolve_layers(pl_module, self.layers, self.layer_types, self.exclude)
        self.layer_names = list(modules)
        self._layer_types = {name: type(m).__name__ for name, m in modules.items()}
        wanted = set(self.stats)
        unit_layers = (
            frozenset(i for i, m in enumerate(modules.values()) if isinstance(m, self.dead_unit_types))
            if "act_dead_frac" in wanted
            else frozenset()
        )
        params: dict[str, nn.Parameter] = {}
        if wanted & set(PARAMETER_STATS):
            # The default selection counts every parameter (also those of non-leaf modules, such as a ViT's
            # cls_token), so grad_norm_total is the norm that clip_grad_norm_ sees; a selection narrows it.
            default = self.layers is None and not self.layer_types
            params = (
                owned_parameters(pl_module, skip=excluded_names(pl_module, self.exclude))
                if default
                else named_parameters_of(modules)
            )
        # A module of the default selection that does not run is usually unused by design (a dropout that fused
        # attention skips, MultiheadAttention's out_proj): a note, not a warning, unless it holds parameters that
        # nothing else observed.
        self._quiet_not_run = (
            {name for name, m in modules.items() if not any(True for _ in m.parameters())}
            if self.layers is None
            else set()
        )
        self._param_names = list(params)
        self._params = list(params.values())
        self._stale_step = None
        self._key_cache: dict[str, list[str]] = {}
        device = pl_module.device
        self._opt_in = plan = plan_opt_in(self.stats, self.precision_targets, trainer.precision)
        if plan.note:
            self._warn_once("opt_in_note", f"LayerHealthCallback: {plan.note}", info=True)
        self._aggregator = LayerStatsAggregator(
            len(modules),
            len(params),
            dtype=accumulation_dtype(device),
            sharded_params=_sharded(trainer, params),
            histogram_bins=self.histogram_bins if self.histogram_every_n_steps else 0,
            **plan.aggregator_kwargs(),
        ).to(device)
        recorder_args: dict[str, Any] = {
            "moments": bool(wanted & set(MOMENT_STATS)),
            "unit_layers": unit_layers,
            "unit_dim": self.unit_dim,
            "names": self.layer_names,
        }
        # The default path keeps the plain StepRecorder: opt-in statistics cost nothing unless asked for.
        self._recorder = (
            OptInRecorder(self._aggregator, plan, **recorder_args)
            if plan.any
            else StepRecorder(self._aggregator, **recorder_args)
        )
        self._saved = SavedMemoryTracker(modules, pl_module) if plan.saved_bytes else None
        self._probes = self._precursor_probes(pl_module, modules)
        if self._probes is not None:
            self._probes.register(self._aggregator)
        on_grad = self._recorder.on_grad if wanted & set(GRADIENT_STATS) or plan.grad_targets else None
        companions = [self._saved] if self._saved is not None else []
        self._hooks = HookSet(modules, None, on_grad, on_tensor=self._recorder.on_tensor, companions=companions)
        self._tracker = (
            ParameterTracker(params, snapshot="param_update_ratio" in wanted, dtype=self._aggregator.acc_dtype)
            if params
            else None
        )
        self._window = None
        self._modes = EvalModeWatch(pl_module) if "eval_mode" in self.rule_config.enabled else None
        self._sentinel_params = list(named_parameters_of(modules).values()) if self.sentinel == "loss+grads" else []
        if self._sentinel is not None:  # every process must trip on the same steps
            self._sentinel.reduce_max = all_reduce_max if trainer.world_size > 1 else None
        self._release_step()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Keep a reference to the micro-batch for the sentinel; attach hooks if its optimizer step is sampled."""
        if self._hooks is None:
            return
        step = trainer.global_step
        if self._window is not None and self._window != step:
            # The previous window's optimizer step happened without a batch end in between.
            self._finish_window(trainer)
        if self._sentinel is not None:
            if self._micro_step != step:
                self._release_step()
                self._micro_step = step
            # A reference, not a copy; the RNG state is a 5 KB host copy (measured 1.5 us on the CPU).
            self._micro.append(MicroBatch(batch, batch_idx, capture_rng(pl_module.device)))
        if step % self.every_n_steps and step != self._sample_next:
            return
        if self._window is None:
            self._open_window(step)
        self._hooks.attach()
        if self._modes is not None:
            self._modes.batch_start()
        if self._probes is not None:
            self._probes.attach()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Add the micro-batch's loss to the sentinel's total for this step (on the device, no host read).

        On a sampled step's first backward, also measure the gradients still held from the previous step (none with
        ``zero_grad``: then this costs no kernel), for ``stale_gradients``.
        """
        if self._sentinel is not None and self._hooks is not None:
            self._sentinel.observe_loss(loss)
        if self._modes is not None and self._hooks is not None and self._hooks.attached:
            self._modes.before_backward()  # the sampled forward ran between batch start and here
        if self._probes is not None and self._probes.attached:
            self._probes.end_forward(loss)  # the forward is over: the probes never see backward
        self._check_stale(trainer)

    def _check_stale(self, trainer: pl.Trainer) -> None:
        """On a sampled step's first backward, measure gradients that are still held from the last step."""
        step = self._window
        # With several optimizers (a GAN), one optimizer's gradients legitimately wait through another's step.
        if step is None or self._stale_step == step or len(trainer.optimizers) != 1:
            return
        self._stale_step = step
        self._stale = stale_gradient_squares(self._params, accumulation_dtype(trainer.lightning_module.device))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Run the sentinel's check; replay a tripped step; measure the weights and gradients of an observed step."""
        if self._aggregator is None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = getattr(scaler, "_scale", None)
        trip = self._check(trainer, pl_module, scale if isinstance(scale, Tensor) else None)
        if self._window is None:
            return
        # Lightning calls this after every closure evaluation; LBFGS evaluates its closure several times per step, at
        # trial points. The first call sees the weights and gradients from before the step; the update ratio then
        # spans the whole step (measured in _finish_window).
        if id(optimizer) not in self._stepped:
            first = not self._stepped
            self._stepped.add(id(optimizer))
            if isinstance(scale, Tensor):
                # Tensor hooks saw the scaled gradients; the scale may change in scaler.update() after this step.
                self._aggregator.grad_scale = scale.detach().clone()
            if self._tracker is not None:
                groups = optimizer.param_groups
                # DeepSpeed's optimizers hold copies of the parameters: membership says nothing there.
                if "not_updated" in self.rule_config.enabled and not isinstance(trainer.strategy, DeepSpeedStrategy):
                    self._watch.observe(optimizer)
                    unheld = self._watch.unheld(self._tracker.params, trainer.optimizers) if first else []
                    groups = [*groups, {"params": unheld}] if unheld else groups  # measured like the stepped ones
                measured = self._tracker.before_step(groups)
                if measured is not None:
                    self._aggregator.update(params=(measured[0], measured[1], slice(None)))
        if trip is None:
            return
        if self.on_anomaly == "raise":
            self._finish_window(trainer, before_update=True)  # raises on any finding, before the update
        elif self.on_anomaly == "stop":
            trainer.should_stop = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Remove hooks; once the sampled step's optimizer has stepped, pool and log it."""
        if self._hooks is None:
            return
        if self._hooks.attached:  # a sampled micro-batch (an unsampled step pays nothing for the check below)
            self._hooks.remove(finished=True)
        if self._probes is not None and self._probes.attached:
            self._probes.end_forward()  # no backward (a training_step that returned no loss): the output still counts
        if self._window is not None and trainer.global_step != self._window:
            self._finish_window(trainer)
        if self._micro_step is not None and trainer.global_step != self._micro_step:
            self._release_step()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation never sees training hooks (an open accumulation window resumes afterwards)."""
        self._detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Remove every hook, drop the unfinished step and release the state (Lightning skips ``teardown`` then).

        The hook set's closures and the device state go, so the callback pickles and deep-copies after a failed fit.
        """
        self._release_fit()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Drop a window whose batch ended without ``on_train_batch_end`` (``on_train_batch_start`` returned -1).

        Hooks still attached here mean Lightning skipped the rest of the epoch after they were attached; they must
        not see the module's own ``on_train_epoch_end`` (called after the callbacks') or anything later.
        """
        if self._hooks is not None and self._hooks.attached:
            self._detach()
            self._discard_window()
            self._release_step()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A step left unfinished at the end of training is dropped, not logged; then the summary is printed."""
        self._detach()
        self._discard_window()
        self._release_step()
        if self.summary and self.last_step is not None:
            rank_zero_info(self.summary_table())

    def summary_table(self) -> str:
        """The end-of-fit table: the last sampled step's values per layer in depth order, findings marked."""
        marks: dict[str, list[str]] = {}
        for finding in self.last_findings:
            marks.setdefault(finding.layer, []).append(finding.rule)
        values = values_from_metrics(self.last_metrics, self.prefix)
        n = len(self.last_findings)
        title = f"LayerHealthCallback: step {self.last_step}, {n} finding{'' if n == 1 else 's'}"
        return format_step_table(values, self.execution_order, marks, title)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove every hook and release the device state."""
        self._release_fit()

    def _release_fit(self) -> None:
        """Drop everything the fit created (hooks, device state, references to the module and its parameters).

        The one place both exits go through (``teardown``, and ``on_exception``, after which Lightning skips
        ``teardown``), so that the callback holds no module or tensor afterwards and pickles.
        """
        self._detach()
        self._discard_window()
        self._release_step()
        self._sentinel_params = []
        self._params = []
        self._hooks = self._recorder = self._aggregator = self._tracker = None
        self._modes = None
        self._saved = None
        self._probes = None
        self._watch = StepWatch()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the configuration and results, not the LightningModule.

        Lightning binds ``log``/``log_dict`` of the LightningModule onto every callback at each fit; pickling or
        deep-copying them would drag in the whole model (and fail on a model that does not pickle). The next fit
        binds them again.
        """
        state = self.__dict__.copy()
        state.pop("log", None)
        state.pop("log_dict", None)
        return state

    @override
    def state_dict(self) -> dict[str, Any]:
        """Checkpointed state: last values, alert state, warnings given, trips and the sentinel's loss baseline.

        Plain Python values only: a checkpoint never stores tensors from hooks.
        """
        return {
            "last_metrics": dict(self.last_metrics),
            "last_step": self.last_step,
            "warned": sorted(self._warned),
            "alerts": self._alerts.state_dict(),
            "findings": [vars(f) for f in self.findings],
            "trips": [vars(t) for t in self.trips],
            "sentinel": self._sentinel.state_dict() if self._sentinel is not None else None,
            "last_finite": dict(self._last_finite),
            "history": self._history.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.last_metrics = dict(state_dict.get("last_metrics", {}))
        self.last_step = state_dict.get("last_step")
        self._warned = set(state_dict.get("warned", []))
        self._alerts.load_state_dict(state_dict.get("alerts", {}))
        self.findings = [Finding(**f) for f in state_dict.get("findings", [])]
        self.trips = [Trip(**t) for t in state_dict.get("trips", [])]
        self._last_finite = dict(state_dict.get("last_finite", {}))
        self._history.load_state_dict(state_dict.get("history", {}))
        if self._sentinel is not None and state_dict.get("sentinel"):
            self._sentinel.load_state_dict(state_dict["sentinel"])

    # ------------------------------------------------------------------------------------------------ internals
    def _open_window(self, step: int, layers: bool = True) -> None:
        assert self._hooks is not None
        self._window = step
        self._window_layers = layers
        self._stepped.clear()
        if self._modes is not None:
            self._modes.take()  # a discarded window's findings are not this one's
        self._watch.release()
        if self._probes is not None and self._aggregator is not None:
            self._probes.reset(self._aggregator.act_moments.device)
        self._hooks.clear_order()
        every = self.histogram_every_n_steps
        if self._recorder is not None:  # replays follow the schedule of sampled steps; parameter-only windows: none
            self._recorder.histograms = layers and every is not None and step % every == 0
        agg = self._aggregator
        if agg is not None and agg.power_sums:
            # Kurtosis sums about the last pooled mean keep their digits when the mean dwarfs the spread; the logged
            # mean is the same on every process, so the sums still add up exactly.
            means = [self.last_metrics.get(f"{self.prefix}/act_mean/{name}", 0.0) for name in self.layer_names]
            shift = [m if math.isfinite(m) else 0.0 for m in means]
            agg.power_shift = torch.tensor(shift, dtype=agg.acc_dtype, device=agg.act_moments.device)

    def _release_step(self) -> None:
        self._micro = []
        self._micro_step = None
        if self._sentinel is not None:
            self._sentinel.discard()

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, scale: Tensor | None) -> Trip | None:
        """The sentinel's check of this optimizer step; on a trip, replay it (or say why not) and open its window."""
        sentinel = self._sentinel
        step = trainer.global_step
        if sentinel is None or self._checked_step == step:
            return None  # LBFGS evaluates its closure several times per step: the first evaluation is checked
        self._checked_step = step
        previous = sentinel.previous_trip
        # With a GradScaler, inf/NaN gradients are routine: the scaler skips that step and lowers its scale.
        grads = [p.grad for p in self._sentinel_params if p.grad is not None] if scale is None else []
        trip = sentinel.check(step, grads, scale)
        if trip is None:
            return None
        if self._window == step:
            trip = replace(trip, replayed=True)  # a sampled step: the hooks saw it as it happened
            if self._traced(trip) and not self._replay_blocker(trainer, pl_module, step, previous):
                entry, origin = self._trace_sampled(trainer, pl_module)
                trip = replace(trip, nan_entry=entry, nan_origin=origin)
        else:
            trace = None
            reason = self._replay_blocker(trainer, pl_module, step, previous)
            if not reason:
                # A NaN/Inf trip is traced back to the module whose forward made it: only replays pay for it.
                trace = NonFiniteTrace(pl_module) if self._traced(trip) else None
                reason = self._replay(trainer, pl_module, step, trace)
            if reason:
                trip = replace(trip, reason=reason)
                if previous == step - 1:
                    self.trips.append(trip)  # recorded, not reported again; sampled steps go on as scheduled
                    return None
                self._open_window(step, layers=False)  # the parameters can still be measured
                self._sample_next = step + 1
            else:
                entry, origin = trace.origin(self.layer_names) if trace is not None else (None, None)
                trip = replace(trip, replayed=True, nan_entry=entry, nan_origin=origin)
        self.trips.append(trip)
        self._trip = trip
        return trip

    def _replay_blocker(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, previous: int | None
    ) -> str | None:
        """Why step ``step`` cannot be replayed, or ``None``."""
        if previous == step - 1:
            return "the previous step tripped too (a failure that persists is reported at its first step)"
        if not pl_module.automatic_optimization:
            return "of manual optimization: training_step steps the optimizer itself, so it cannot be re-run"
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or isinstance(strategy, DeepSpeedStrategy):
            return (
                f"the {type(strategy).__name__} strategy is not replayed: outside its wrapper a replay could"
                " communicate or write gradients (FSDP's backward reduce-scatters into .grad)"
            )
        if _sharded(trainer, dict(pl_module.named_parameters())):
            return "the parameters are sharded (DTensor): a replay could communicate or write gradients"
        if self._micro_step != step or not self._micro:
            return "its micro-batches were not seen by the callback (training resumed inside the step?)"
        return None

    def _traced(self, trip: Trip) -> bool:
        # Only the nonfinite rule reads where a NaN/Inf was made.
        return trip.kind != "loss_spike" and "nonfinite" in self.rule_config.enabled

    def _trace_sampled(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[str | None, str | None]:
        """Where the NaN/Inf of a sampled step was made: its micro-batches run again through the trace alone.

        The hooks saw the step as it happened but cannot see functional code between two layers; step 0, where a bad
        initialisation shows, is always sampled. The window's hooks are still attached (batch end removes them) and
        must not count the re-run, so they are removed first. A re-run that fails names nothing.
        """
        assert self._hooks is not None
        self._hooks.remove(finished=True)
        trace = NonFiniteTrace(pl_module)
        run = self._replay_run(trainer, pl_module)
        try:
            replay_step(self._micro, run, pl_module, HookSet({}, _ignore_output), pl_module.device, trace)
        except Exception:  # the finding keeps what the hooks saw; training goes on untouched
            return None, None
        return trace.origin(self.layer_names)

    def _replay(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, trace: NonFiniteTrace | None = None
    ) -> str | None:
        """Replay step ``step`` through the hooks (and ``trace``) into a new window; on failure, drop it, say why."""
        self._open_window(step)
        failure = ""
        run = self._replay_run(trainer, pl_module)
        if self._probes is not None:
            run = self._probe_forward(run)
        try:
            replay_step(self._micro, run, pl_module, self._hooks, pl_module.device, trace)
        except Exception as error:  # a failed replay is reported in the finding; training goes on untouched
            failure = f"the replay raised {type(error).__name__}: {error}"
        finally:
            if self._probes is not None:
                self._probes.remove()
        flag = torch.tensor([1.0 if failure else 0.0], device=pl_module.device)
        # Every process must agree, or the pooled statistics' collectives would not match.
        if all_reduce_max(flag).item() > 0:
            self._discard_window()
            return failure or "the replay failed on another process"
        return None

    @staticmethod
    def _replay_run(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable[[MicroBatch], Tensor | None]:
        """One micro-batch's loss as the automatic-optimization loop back-propagates it."""
        takes_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        accumulate = trainer.accumulate_grad_batches

        def run(micro: MicroBatch) -> Tensor | None:
            args = (micro.batch, micro.batch_idx) if takes_index else (micro.batch,)
            # The LightningModule itself, not the DDP wrapper: DDP's reducer must not see this backward.
            with trainer.precision_plugin.train_step_context(), _logging_silenced(pl_module):
                output = pl_module.training_step(*args)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if not isinstance(loss, Tensor):
                return None
            loss = loss / accumulate
            return scaler.scale(loss) if scaler is not None else loss

        return run

    def _probe_forward(self, run: Callable[[MicroBatch], Tensor | None]) -> Callable[[MicroBatch], Tensor | None]:
        """``run`` with the precursor probes on during its forward (a replay: no loss for ``logit_drift``)."""
        probes = self._probes
        assert probes is not None

        def probed(micro: MicroBatch) -> Tensor | None:
            probes.attach()
            try:
                return run(micro)
            finally:
                probes.end_forward()

        return probed

    def _detach(self) -> None:
        if self._probes is not None:
            self._probes.remove()
        if self._hooks is not None:
            self._hooks.remove()  # an interrupted micro-batch's saved bytes are not a measurement

    def _discard_window(self) -> None:
        self._window = None
        self._trip = None
        self._stale = None
        if self._recorder is not None:
            self._recorder.release()
            self._recorder.no_float_output.clear()
            self._recorder.empty_output.clear()
            self._recorder.sparse_output.clear()
        if self._aggregator is not None:
            self._aggregator.reset()
            self._aggregator.grad_scale = None
        if self._tracker is not None:
            self._tracker.release()
        self._watch.release()
        if self._saved is not None:
            self._saved.pop_peak()

    def _precursor_probes(
        self, pl_module: pl.LightningModule, modules: Mapping[str, nn.Module]
    ) -> PrecursorProbes | None:
        """The attention and output-logit probes of the requested precursor statistics, or ``None``."""
        if not set(PRECURSOR_STATS) & set(self.stats):
            return None
        every = named_modules(pl_module)
        output = modules
        if self.output_layer is not None:
            if self.output_layer not in every:
                raise unmatched_error(self.output_layer, "output_layer", list(every))
            output = {self.output_layer: every[self.output_layer]}
        return PrecursorProbes(self.stats, attention_scope(every, list(modules)), output)

    def _warn_once(self, key: str, message: str, info: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            if info:
                rank_zero_info(message)
            else:
                rank_zero_warn(message, category=LayerHealthWarning)

    def _finish_window(self, trainer: pl.Trainer, before_update: bool = False) -> None:
        """Pool, log and diagnose the open window; ``before_update``: the optimizer has not stepped (no update)."""
        assert self._aggregator is not None
        assert self._hooks is not None
        assert self._recorder is not None
        step = self._window
        assert step is not None
        agg = self._aggregator
        updated = None
        if self._tracker is not None:
            if before_update:
                self._tracker.release()  # there is no update to measure
            else:
                updated = self._tracker.after_step()
        if self._saved is not None:
            agg.add_saved_bytes(self._saved.pop_peak())  # one host-to-device copy per sampled step
        if self._probes is not None:
            self._probes.fold(agg)
        # Every process takes part in the reduction, also one whose layers did not run.
        agg.update(params=None if updated is None else (updated[0], updated[1], P_UPDATE_SQ))
        values = agg.compute()  # reduced over processes: one SUM and one MAX all-reduce (aggregation.py)
        skip = {"param_update_ratio"} if before_update else set()
        if not self._window_layers:
            skip.update(LAYER_STATS)
        wanted = [s for s in (*LAYER_STATS, *PER_PARAMETER_STATS) if s in self.stats and s not in skip]
        if self._window_layers:
            wanted += self._opt_in.logged
        names = [*wanted, "count", "grad_count", "param_seen", "grad_norm_total"]
        stale, self._stale = self._stale, None
        if stale is not None:
            values = {**values, "stale_grad_sq": stale.to(values["count"].device)}
            names.append("stale_grad_sq")
        if "param_norm" in wanted and "param_norm_min" in values:  # replicated parameters of a distributed run
            names.append("param_norm_min")
        histograms = self._recorder.histograms
        if histograms:
            names += ["act_hist", "grad_hist"]
        precursors, precursor_names = self._probes.finalize(values) if self._probes is not None else ({}, {})
        values = {**values, **precursors}
        names += list(precursors)
        parts = [values[name].reshape(-1).to(torch.float64) for name in names]
        flat = torch.cat(parts).tolist()  # the one host transfer
        ends = list(itertools.accumulate(p.numel() for p in parts))
        host = {name: flat[end - part.numel() : end] for name, part, end in zip(names, parts, ends, strict=True)}
        if self._window_layers:  # a window of parameters only keeps the last observed order for the rules
            self.execution_order = self._hooks.fired_names()
        backward_order = [self._hooks.names[i] for i in self._hooks.grad_order]
        missing = self._hooks.missing_grads()  # the whole window's, replays included: rule no_gradient
        eval_mode = self._modes.take() if self._modes is not None else {}
        self._hooks.clear_order()
        no_float = sorted(self._recorder.no_float_output)
        self._recorder.no_float_output.clear()
        self._recorder.release()
        agg.reset()
        agg.grad_scale = None
        self._window = None
        metrics, values = self._log(trainer, step, host, wanted, no_float, precursor_names)
        if stale is not None:  # passed to the rules, not logged: it is 0 on every healthy step
            held = zip(self._param_names, host["stale_grad_sq"], strict=True)
            values["param_stale_grad_norm"] = {name: math.sqrt(sq) for name, sq in held if sq != 0}
        if "param_norm_min" in host:  # not logged: what replica_divergence compares param_norm with
            present = zip(self._param_names, host["param_norm_min"], host["param_seen"], strict=True)
            values["param_norm_min"] = {name: low for name, low, seen in present if seen > 0}
        facts = self._watch.facts(self._param_names, self._tracker.params) if self._tracker is not None else {}
        self._watch.release()
        if histograms:
            self._log_histograms(trainer, step, host["act_hist"], host["grad_hist"], agg.histogram_edges)
        self._note_missing_grads(missing)
        try:
            self._diagnose(trainer, step, values, backward_order, missing, eval_mode, facts)
        finally:
            self._raise_logger_error()

    def _keys(self, stat: str, names: list[str]) -> list[str]:
        # The same keys on every sampled step: formatted once (1,000 f-strings cost ~0.2 ms a step).
        keys = self._key_cache.get(stat)
        if keys is None or len(keys) != len(names):
            keys = self._key_cache[stat] = [f"{self.prefix}/{stat}/{name}" for name in names]
        return keys

    def _log(
        self,
        trainer: pl.Trainer,
        step: int,
        host: dict[str, list[float]],
        wanted: list[str],
        no_float: list[int],
        precursors: Mapping[str, list[str]] | None = None,
    ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Log the step; returns the metrics and the same values by statistic and name (what the rules read)."""
        count, grad_count, seen = host["count"], host["grad_count"], host["param_seen"]
        metrics: dict[str, float] = {}
        values: dict[str, dict[str, float]] = {}
        for stat in wanted:
            if stat in PER_PARAMETER_STATS:
                names, present = self._param_names, [s > 0 for s in seen]
            else:
                ran = grad_count if counted_by_gradient(stat) else count
                names, present = self.layer_names, [c > 0 for c in ran]
            # NaN: not a ReLU-family layer (act_dead_frac); undefined for this output (an opt-in statistic of an
            # all-zero or constant output).
            undefined_skipped = stat == "act_dead_frac" or stat in self._opt_in.logged
            group: dict[str, float] = {}
            for key, name, value, ok in zip(self._keys(stat, names), names, host[stat], present, strict=True):
                if ok and not (undefined_skipped and value != value):
                    metrics[key] = group[name] = value
            if group:
                values[stat] = group
        for stat, names in (precursors or {}).items():
            group = {n: v for n, v in zip(names, host[stat], strict=True) if n and v == v}  # NaN: not observed
            if group:
                values[stat] = group
                if stat in PRECURSOR_STATS:
                    metrics.update({f"{self.prefix}/{stat}/{n}": v for n, v in group.items()})
        if "grad_norm_total" in self.stats and any(s > 0 for s in seen):
            metrics[f"{self.prefix}/grad_norm_total"] = host["grad_norm_total"][0]
        # Depth travels as data so that a report can order layers from the logs of any logger.
        observed = {name for name, c in zip(self.layer_names, count, strict=True) if c > 0}
        for depth, name in enumerate(n for n in self.execution_order if n in observed):
            metrics[f"{self.prefix}/depth/{name}"] = float(depth)

        for i in sorted(self._aggregator.unit_mismatch if self._aggregator is not None else ()):
            name = self.layer_names[i]
            self._warn_once(
                f"unit_mismatch:{name}",
                f"LayerHealthCallback: the number of units of {name!r} changed between calls or differs between"
                " processes (a module shared by inputs of different widths); act_dead_frac is not tracked for it",
            )
        for i in no_float:
            name = self.layer_names[i]
            self._warn_once(
                f"no_float:{name}",
                f"LayerHealthCallback: the output of {name!r} holds no floating-point tensor; it is not observed",
            )
        no_float_names = {self.layer_names[i] for i in no_float}
        assert self._recorder is not None
        sparse = {self.layer_names[i] for i in self._recorder.sparse_output}
        for name in sorted(sparse):
            self._warn_once(
                f"sparse:{name}",
                f"LayerHealthCallback: the output of {name!r} (or its gradient) is a sparse tensor; sparse tensors"
                " are not observed",
            )
        empty = {self.layer_names[i] for i in self._recorder.empty_output}
        self._recorder.sparse_output.clear()
        self._recorder.empty_output.clear()
        ran = [name for name, c in zip(self.layer_names, count, strict=True) if c > 0]
        for name, c in zip(self.layer_names, count, strict=True):
            if c == 0 and name in empty:
                self._warn_once(
                    f"empty:{name}",
                    f"LayerHealthCallback: selected module {name!r} ran during sampled step {step} but its output had"
                    " no elements; no statistics for it",
                )
            elif c == 0 and name not in no_float_names and name not in sparse and self._window_layers:
                # Inside a selected module that ran (MultiheadAttention's out_proj): observed through it.
                covered = self.layers is None and any(name.startswith(r + ".") for r in ran)
                self._warn_once(
                    f"not_run:{name}",
                    f"LayerHealthCallback: selected module {name!r} did not run during sampled step {step} (its"
                    " forward was called directly instead of the module, or a branch was not taken); no statistics"
                    " for it",
                    info=covered or name in self._quiet_not_run,
                )

        self.last_metrics = metrics
        self.last_step = step
        for logger in trainer.loggers:
            try:
                logger.log_metrics(metrics, step=step)
            except Exception as error:  # the other loggers and the rules still get the step; raised after them
                self._logger_error = self._logger_error or error
        return metrics, values

    def _raise_logger_error(self) -> None:
        error, self._logger_error = self._logger_error, None
        if error is not None:
            raise error

    def _note_missing_grads(self, missing: list[str]) -> None:
        # A note, not a warning: rule no_gradient reports the outputs that cut the network off from the gradient;
        # the others (a pooler under a token-level head) do not reach the loss by design.
        for name in missing:
            self._warn_once(
                f"no_grad:{name}",
                f"LayerHealthCallback: the output of {name!r} required grad but received no gradient on a sampled"
                " step (a detached branch, or an output that does not reach the loss); no act_grad statistics for"
                " it",
                info=True,
            )

    def _log_histograms(
        self, trainer: pl.Trainer, step: int, act: list[float], grad: list[float], edges: Tensor
    ) -> None:
        bins = self.histogram_bins
        inner = edges.tolist()
        # Outer bins are open-ended; give them a finite edge a decade out for loggers that need one.
        limits = [*inner, inner[-1] * 10]
        left = [inner[0] * 10, *inner]
        skipped = []
        for logger in trainer.loggers:
            write = _histogram_writer(logger)
            if write is None:
                skipped.append(type(logger).__name__)
                continue
            try:
                for kind, counts in (("act_hist", act), ("act_grad_hist", grad)):
                    for i, name in enumerate(self.layer_names):
                        row = counts[i * bins : (i + 1) * bins]
                        if sum(row) > 0:
                            write(f"{self.prefix}/{kind}/{name}", row, left, limits, step)
            except Exception as error:  # as in _log: the other loggers and the rules first
                self._logger_error = self._logger_error or error
        if skipped:
            self._warn_once(
                "histograms:" + ",".join(skipped),
                f"LayerHealthCallback: {', '.join(skipped)} cannot store histograms; they are logged only to"
                " TensorBoard and W&B loggers",
                info=True,
            )

    def _diagnose(
        self,
        trainer: pl.Trainer,
        step: int,
        values: dict[str, dict[str, float]],
        backward_order: list[str],
        missing_grads: list[str],
        eval_mode: dict[str, str],
        facts: Mapping[str, ParamFacts],
    ) -> None:
        trip, self._trip = self._trip, None
        findings = evaluate(
            values,
            self.execution_order,
            backward_order,
            step,
            self.rule_config,
            self._layer_types,
            trip=trip,
            baseline=self._baseline,
            last_finite=self._last_finite,
            missing_grads=missing_grads,
            eval_mode=eval_mode,
            param_facts=facts,
            history=self._history,
        )
        self._history.push(step, values)
        for name, norm in values.get("param_norm", {}).items():
            if math.isfinite(norm):
                self._last_finite[name] = step
        if trip is None:
            self._baseline = Baseline(step, values)  # what the next loss spike is compared with
        self.last_findings = findings
        new = self._alerts.update(findings)
        self.findings.extend(new)
        if self.on_anomaly == "raise" and findings:
            raise LayerHealthError(format_error(findings))
        if self.on_anomaly in ("warn", "stop"):
            for finding in new:
                rank_zero_warn(f"LayerHealthCallback: {finding.message}", category=LayerHealthWarning)
        if self.on_anomaly == "stop" and findings:
            trainer.should_stop = True
