"""``LayerHealthCallback``: when to observe, and where the results go.

Its hook methods translate the Trainer's events into calls of the fit's engine,
:class:`~lightning_hookdiag._fit_run.FitRun` (handed :class:`~lightning_hookdiag._replay.LightningStep` for what only
the Trainer can do), and log what comes back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_deprecation, rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_hookdiag._config import (
    MeasureConfig,
    OutputConfig,
    SentinelConfig,
    coerce,
    delegate,
    regroup,
    sentinel_config,
)
from lightning_hookdiag._diagnosis import Diagnosis
from lightning_hookdiag._distributed import all_reduce_max
from lightning_hookdiag._errors import LayerHealthError, LayerHealthWarning, MissingExtraError
from lightning_hookdiag._fit_run import FitRun
from lightning_hookdiag._heatmap_image import render
from lightning_hookdiag._keys import ALERTS_ACTIVE, step_key
from lightning_hookdiag._logged_values import (
    Note,
    ObservedStep,
    histogram_note,
    no_logger_note,
)
from lightning_hookdiag._opt_in import resolve_targets
from lightning_hookdiag._publish import FindingsWriter, write_all_clear, write_image
from lightning_hookdiag._replay import LightningStep, sharded
from lightning_hookdiag._selection import import_types
from lightning_hookdiag._sentinel import LossSentinel, NoSentinel, Sentinel
from lightning_hookdiag._stats import resolve_stats
from lightning_hookdiag._step_state import Trip
from lightning_hookdiag._table import format_step_table, plural
from lightning_hookdiag._validation import check, choice, integer, module_names
from lightning_hookdiag._vocabulary import OUTPUT_LAYER_STATS
from lightning_hookdiag.builtins import every_rule, split_extensions
from lightning_hookdiag.components import ComponentFactory, FitConfig
from lightning_hookdiag.rules import Finding, Rule, RuleConfig, format_error, values_from_metrics

__all__ = ["LayerHealthCallback"]

ON_ANOMALY = ("warn", "raise", "stop", "ignore")

# The heatmap's columns: the latest sampled steps kept for it (a bound on what the callback holds, whatever the run's
# length; 256 columns of 8 pixels are wider than any dashboard shows).
HEATMAP_COLUMNS = 256


HistogramWriter = Callable[[str, list[float], list[float], list[float], int], None]


def _histogram_writer(logger: Logger) -> HistogramWriter | None:
    """A function writing one histogram to ``logger``, or ``None`` if the logger cannot store histograms.

    The logger's ``prefix`` applies as to scalars (TensorBoard: with the function its scalar-only ``log_metrics`` uses).
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

            histogram = wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray([left[0], *right])))
            logger.log_metrics({tag: histogram}, step=step)  # type: ignore[dict-item]

        return wandb_histogram
    return None


def _stepping_optimizers(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[torch.optim.Optimizer]:
    """The optimizers whose step ends a sampled micro-batch's recording; none under manual optimization."""
    if not pl_module.automatic_optimization:
        return []
    return [optimizer for optimizer in trainer.optimizers if isinstance(optimizer, torch.optim.Optimizer)]


def _check_prefix_unique(callbacks: Sequence[Callback]) -> None:
    """Raise if two ``LayerHealthCallback`` of the Trainer share a ``prefix``: their keys would overwrite each other."""
    seen: dict[str, tuple[int, LayerHealthCallback]] = {}
    for index, callback in enumerate(callbacks):
        if not isinstance(callback, LayerHealthCallback):
            continue
        first, other = seen.setdefault(callback.prefix, (index, callback))
        if other is callback:
            continue
        raise ValueError(
            f"LayerHealthCallback: trainer.callbacks[{first}] (layers={other.layers}) and trainer.callbacks[{index}]"
            f" (layers={callback.layers}) both log under prefix={callback.prefix!r}: their keys (such as"
            f" {callback.prefix}/grad_norm_total and {callback.prefix}.act_std/<depth>_<layer>) would overwrite each"
            f" other at every step; give each its own prefix=, e.g."
            f" LayerHealthCallback(..., prefix={callback.prefix + '_2'!r})"
        )


class LayerHealthCallback(Callback):
    r"""Log per-layer activation and gradient health on a fixed interval of optimizer steps.

    Optimizer step ``k`` is the step that starts with ``trainer.global_step == k``; it is *sampled* when
    ``k % every_n_steps == 0``. On a sampled step, hooks are attached to the selected modules at the start of each
    of its micro-batches and removed at the end of each; they observe the training step's own forwards and backwards,
    not another callback's (``docs/integrations.md#what-a-sampled-step-records``). Everything observed is pooled
    exactly (over calls, micro-batches and processes) and, once the optimizer has stepped, logged once to every logger
    of the Trainer with ``step=k``. The same values are kept in :attr:`last_metrics`, also without a logger (said
    once). A fresh fit starts with no results and an empty alert memory; a checkpoint restores them only when a fit
    resumes from it (``test``/``validate``/``predict`` with ``ckpt_path`` keep the fit's). Hooks never exist outside a
    sampled training batch (not in validation, not after ``fit`` or an exception). Training is bit-identical with and
    without the callback.

    Keys are shaped for the dashboards (``docs/statistics.md#keys``), all logged with ``step=k``:

    - ``<prefix>.<stat>/<depth>_<layer>``: one layer's value, e.g. ``layer_health.act_std/07_net.7``; one dashboard
      group per statistic, layers in forward order when sorted as strings. Parameter statistics use the parameter's
      dotted name with its layer's depth (``layer_health.param_norm/07_net.7.weight``).
    - ``<prefix>/grad_norm_total``, ``<prefix>/<stat>_min`` / ``_max`` and ``<prefix>/alerts_active``: the summary
      group, one page with the total gradient norm, the worst layer's value of each statistic of
      :data:`~lightning_hookdiag._vocabulary.SUMMARIES` and the count of active alerts (the rules' findings on the
      step).

    ``<depth>`` is the layer's place in the forward order of the first sampled step it ran on, zero-padded; a
    parameter of the LightningModule itself (or of a layer that has not run) has ``x`` digits and sorts last. Values
    that are undefined (``param_update_ratio`` of weights that were all 0) are left out with a one-time note; NaN
    and Inf are logged only where the tensors held or produced them. The default and opt-in statistics, their
    definitions and the histograms are in ``docs/statistics.md``. The always-on sentinel and its
    replay of a tripped step are in ``docs/sentinel.md``, the rules in ``docs/rules.md``.

    Args:
        every_n_steps: Sample optimizer steps ``0, n, 2n, ...``; any integral number. Under manual optimization
            with several optimizer steps per batch (a GAN), a sampled step inside a batch is observed on the next
            batch, logged at its first step (``docs/statistics.md#which-steps-are-sampled``).
        layers: Dotted module names or fnmatch globs (``*`` also crosses dots), relative to the LightningModule,
            as listed by :func:`~lightning_hookdiag.list_layers`. ``None`` selects every leaf module and every
            module that computes with parameters it owns, such as ``nn.MultiheadAttention``, except loss modules
            and torchmetrics metrics (or, with ``MeasureConfig.layer_types``, every module of those types), and
            tracks every parameter of the LightningModule.
        stats: Names of the statistics to compute and log, the full list; ``None`` for the default set
            (:data:`~lightning_hookdiag.ALL_STATS`). Work for statistics not asked for is skipped (e.g. without
            ``"param_update_ratio"`` no weight copy is made). The names of
            :data:`~lightning_hookdiag.OPT_IN_STATS` are computed only when listed here or in
            ``MeasureConfig.extra_stats``.
        prefix: First segment of every logged key; two callbacks on one Trainer need distinct ones.
        on_anomaly: What to do when a health rule fires on a sampled step (see :mod:`lightning_hookdiag.rules`):
            ``"warn"`` (a :class:`~lightning_hookdiag.LayerHealthWarning` naming the rule and the layer, once per rule
            and layer until it clears), ``"raise"`` (:class:`~lightning_hookdiag.LayerHealthError` naming the origin
            of the earliest problem), ``"stop"`` (warn, then stop training gracefully) or ``"ignore"`` (findings are
            still recorded in :attr:`findings`).
        measure: What else is measured: a :class:`~lightning_hookdiag.MeasureConfig` or a mapping of its fields
            (``layer_types``, ``exclude``, ``extra_stats``, ``dead_unit_types``, ``unit_dim``,
            ``precision_targets``, ``output_layer``, ``histogram_every_n_steps``, ``histogram_bins``); ``None``: its
            defaults.
        sentinel: What is checked on *every* optimizer step (``docs/sentinel.md``): ``"loss"`` (default; NaN/Inf
            or a spike in the loss), ``"loss+grads"`` (also NaN/Inf in the selected parameters' gradients),
            ``None``, or a :class:`~lightning_hookdiag.SentinelConfig` (or a mapping of its fields) with the spike
            test's settings or a detector of your own. A step that trips is replayed with hooks before the optimizer
            applies it, without side effects, and logged at ``step=k``; where it cannot be, the finding says why and
            the next step is sampled.
        rules: Rule settings: a :class:`~lightning_hookdiag.RuleConfig`, or a mapping of its fields, e.g.
            ``{"dead_frac_threshold": 0.5, "enabled": ["nonfinite", "dead_units"]}`` (from YAML).
        output: What is written besides each sampled step's values: an :class:`~lightning_hookdiag.OutputConfig` or a
            mapping of its fields (``summary``, ``charts``, ``heatmap_stats``, ``heatmap_every_n_steps``); ``None``:
            its defaults.
        extensions: This callback's own rules (functions decorated with :func:`~lightning_hookdiag.rules.rule`) and
            component factories (decorated with :func:`~lightning_hookdiag.components.component`), run beside the
            built-in ones (:mod:`lightning_hookdiag.builtins`) in this callback's fits only; ``rules={"enabled":
            [...]}`` may name its rules (``docs/extending.md``).
        **deprecated: The flat keywords of earlier releases (``layer_types=``, ``summary=``, ...: every field of
            ``MeasureConfig`` and ``OutputConfig``), accepted for one release with a ``DeprecationWarning`` naming the
            new spelling. Setting one beside the same field of its group is a ``ValueError``.

    Attributes:
        last_metrics: The statistics logged on the most recent sampled step (pooled over processes, on every process):
            every key logged with them but ``<prefix>/alerts_active`` (the alerts are :attr:`last_findings`).
        last_step: The optimizer step :attr:`last_metrics` describes.
        layer_names: Names of the observed modules, in selection order (set when fit starts).
        execution_order: Names of the modules in the order their forward first ran on the last sampled step (agreed
            over processes: ``docs/integrations.md#ddp``).
        findings: Every finding that alerted (first appearance of a rule on a layer, or its return after clearing).
        last_findings: All findings of the most recent sampled step, earliest origin first.
        trips: Every optimizer step the sentinel tripped on, with whether it was replayed and, if not, why.
        alert_counts: Rule name to its number of findings, alerted or not, since the results were last reset.
        measure_config: ``measure=`` as a validated :class:`~lightning_hookdiag.MeasureConfig`.
        sentinel_config: ``sentinel=`` as a validated :class:`~lightning_hookdiag.SentinelConfig`.
        rule_config: ``rules=`` as a validated :class:`~lightning_hookdiag.RuleConfig`.
        output_config: ``output=`` as a validated :class:`~lightning_hookdiag.OutputConfig`.

    Raises:
        ValueError: At construction, for any invalid argument (the message names it and the valid values); when
            fit starts, for a name, glob or type that matches no module (with the closest names), or for another
            ``LayerHealthCallback`` of the Trainer with the same ``prefix`` (naming both).

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_hookdiag import MeasureConfig, SentinelConfig
        >>> callback = LayerHealthCallback(
        ...     every_n_steps=2,
        ...     stats=["act_mean", "act_std"],
        ...     measure=MeasureConfig(dead_unit_types=["torch.nn.ReLU"]),
        ...     sentinel=SentinelConfig(mode="loss+grads", warmup=5),
        ...     rules={"dead_frac_threshold": 0.5},
        ...     output={"summary": False},  # a mapping of OutputConfig's fields, as YAML gives it
        ... )
        >>> trainer = pl.Trainer(max_steps=3, callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, enable_checkpointing=False)
        >>> trainer.fit(BoringModel())
        >>> sorted(callback.last_metrics)
        ['layer_health.act_mean/0_layer', 'layer_health.act_std/0_layer', 'layer_health/act_std_min']
        >>> callback.last_step
        2
    """

    # The results, set anew by _start_fresh (the Attributes above).
    last_metrics: dict[str, float]
    last_step: int | None
    execution_order: list[str]
    findings: list[Finding]
    last_findings: list[Finding]
    trips: list[Trip]
    _warned: set[str]
    _diagnosis: Diagnosis
    _writer: FindingsWriter
    _heatmap: dict[str, deque[tuple[int, dict[str, float]]]]

    def __init__(
        self,
        every_n_steps: int = 50,
        layers: Sequence[str] | None = None,
        *,
        stats: Sequence[str] | None = None,
        prefix: str = "layer_health",
        on_anomaly: Literal["warn", "raise", "stop", "ignore"] = "warn",
        measure: MeasureConfig | dict[str, Any] | None = None,
        sentinel: SentinelConfig | Literal["loss", "loss+grads"] | dict[str, Any] | None = "loss",
        rules: RuleConfig | dict[str, Any] | None = None,
        output: OutputConfig | dict[str, Any] | None = None,
        extensions: Sequence[Rule | ComponentFactory] = (),
        **deprecated: Any,
    ) -> None:
        self.every_n_steps: int = integer("every_n_steps", every_n_steps, "an integer >= 1", lambda v: v >= 1)
        self.prefix: str = check(
            "prefix",
            prefix,
            "a non-empty key segment without leading/trailing '/'",
            lambda p: isinstance(p, str) and bool(p.strip("/")) and p == p.strip("/"),
        )
        self.on_anomaly = choice("on_anomaly", on_anomaly, ON_ANOMALY)
        self.layers = module_names("layers", layers)
        groups, messages = regroup(deprecated, {"measure": measure, "output": output})
        for message in messages:
            rank_zero_deprecation(message, stacklevel=6)  # names the line that built the callback
        self.measure_config = coerce(MeasureConfig, groups["measure"], "measure")
        self.output_config = coerce(OutputConfig, groups["output"], "output")
        self.rule_config = rules if isinstance(rules, RuleConfig) else RuleConfig.from_mapping(rules)
        self.sentinel_config = sentinel_config(sentinel, self.rule_config.deprecated_sentinel_settings())
        self.stats = resolve_stats([*resolve_stats(stats), *self.measure_config.extra_stats])
        self._check_against_each_other()
        # Created here, not when fit starts: a checkpoint's baseline is loaded before on_fit_start runs.
        self._sentinel: Sentinel = NoSentinel()
        if self.sentinel_config.mode is not None:
            self._sentinel = LossSentinel(self.sentinel_config.mode, self.sentinel_config.build_detector())
        self.layer_names: list[str] = []
        self._run: FitRun | None = None  # everything one fit creates, from on_fit_start to _release_fit
        self._stage: str | None = None  # the Trainer's stage: a checkpoint restores this state only in a fit
        self.extensions = split_extensions(extensions)  # checked here; with rule_config, by _start_fresh's Diagnosis
        self._start_fresh()

    def _check_against_each_other(self) -> None:
        """The settings of one group that are valid only with those of another (each group checked itself)."""
        measure, output, every = self.measure_config, self.output_config, self.every_n_steps
        for field, value in (
            ("MeasureConfig.histogram_every_n_steps", measure.histogram_every_n_steps),
            ("OutputConfig.heatmap_every_n_steps", output.heatmap_every_n_steps),
        ):
            if value is not None and value % every != 0:
                raise ValueError(f"{field}: expected None or a positive multiple of every_n_steps={every}, got {value}")
        if measure.output_layer is not None and not set(OUTPUT_LAYER_STATS) & set(self.stats):
            raise ValueError(
                f"MeasureConfig.output_layer={measure.output_layer!r} names the layer of logit_lse_mean /"
                " logit_absmax, but stats= includes neither; add them to stats= or leave output_layer=None"
            )

    # The flat names of earlier releases, read-only: each reads its group's field.
    layer_types = delegate("measure_config", "layer_types")
    dead_unit_types = delegate("measure_config", "dead_unit_types")
    unit_dim = delegate("measure_config", "unit_dim")
    precision_targets = delegate("measure_config", "precision_targets")
    output_layer = delegate("measure_config", "output_layer")
    histogram_every_n_steps = delegate("measure_config", "histogram_every_n_steps")
    histogram_bins = delegate("measure_config", "histogram_bins")
    summary = delegate("output_config", "summary")
    charts = delegate("output_config", "charts")
    heatmap_stats = delegate("output_config", "heatmap_stats")
    heatmap_every_n_steps = delegate("output_config", "heatmap_every_n_steps")
    sentinel = delegate("sentinel_config", "mode")

    @property
    def exclude(self) -> list[str]:
        """``MeasureConfig.exclude`` as a list, as earlier releases kept it (and as :attr:`state_key` names it)."""
        return list(self.measure_config.exclude)

    @property
    def alert_counts(self) -> dict[str, int]:
        """A copy of the counts (see the class's Attributes)."""
        return dict(self._diagnosis.alerts.counts)

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
        """Start fresh when the Trainer starts from step 0 (Lightning restores a ``ckpt_path`` after ``setup``).

        A second ``fit`` of the same Trainer goes on from its step and keeps what the first one found.
        """
        self._stage = stage
        if stage == "fit" and trainer.global_step == 0:
            self._start_fresh()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve the selection (errors for names that match nothing) and allocate the device state."""
        self._release_fit()  # a fit that ended without teardown (an interrupted one) leaves nothing behind
        _check_prefix_unique(trainer.callbacks)  # type: ignore[attr-defined]  # set by Lightning's CallbackConnector
        self._build_run(trainer, pl_module)
        assert self._run is not None
        for note in self._run.fit_notes():
            self._note(note)
        self._note(no_logger_note(len(trainer.loggers)))
        # Every process must trip on the same steps.
        self._sentinel.reduce_max = all_reduce_max if trainer.world_size > 1 else None
        self._sentinel.discard()

    def _build_run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read the model: resolve the selection and build the fit's run objects (again, after the model changed)."""
        self._release_fit()
        config, shards = self._fit_config(), lambda params: sharded(trainer, params)
        self._run = FitRun(config, pl_module, trainer.precision, shards, self._sentinel, self.extensions)
        self.layer_names = list(self._run.layer_names)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Keep a reference to the micro-batch for the sentinel; attach hooks if its optimizer step is sampled."""
        if (run := self._run) is None:
            return
        self._close_past(trainer, run)  # its optimizer step happened without a batch end in between
        if run.read_again(trainer.global_step):  # the module replaced a layer after the callback read it
            self._build_run(trainer, pl_module)
            assert self._run is not None
            run = self._run
        optimizers = _stepping_optimizers(trainer, pl_module)
        self._note(run.begin_micro_batch(trainer.global_step, batch, batch_idx, optimizers, self.last_metrics))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Add the micro-batch's loss to the sentinel's total (on the device); end an observed step's forward."""
        if self._run is not None:
            self._run.before_backward(loss, len(trainer.optimizers))

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """End a sampled micro-batch's recording after its backward, unless the optimizer is stepping (LBFGS)."""
        if self._run is not None:
            self._run.after_backward()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Run the sentinel's check; replay a tripped step; measure the weights and gradients of an observed step.

        A trip is recorded; one without a window of its step (a failure that persists) is written at once.
        """
        if (run := self._run) is None:
            return
        step, loop = trainer.global_step, LightningStep(trainer, pl_module)
        checked = run.check_step(step, optimizer, loop, self._diagnosis.traces, self.last_metrics)
        if checked is None:
            return
        self.trips.append(checked.trip)
        if not checked.observed:
            self._raise_first(self._writer.write(trainer.loggers, step, [], [checked.trip]))
        elif self.on_anomaly == "raise":  # raises on any finding, before the update
            self._finish(trainer, run.collect_before_update(self.execution_order))
        elif self.on_anomaly == "stop":
            trainer.should_stop = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Remove hooks; once the sampled step's optimizer has stepped, pool and log it."""
        if (run := self._run) is None:
            return
        run.end_micro_batch()
        self._close_past(trainer, run)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation never sees training hooks (an open accumulation window resumes afterwards)."""
        if self._run is not None:
            self._run.detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Release the fit as :meth:`teardown` does: Lightning skips ``teardown`` after an exception."""
        self.teardown(trainer, pl_module, "fit")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Drop a window whose batch ended without ``on_train_batch_end`` (``on_train_batch_start`` returned -1).

        Hooks still attached here mean Lightning skipped the rest of the epoch after they were attached; they must
        not see the module's own ``on_train_epoch_end`` (called after the callbacks') or anything later.
        """
        if self._run is not None:
            self._run.end_epoch()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A step left unfinished at the end of training is dropped, not logged; then the summary is printed."""
        if self._run is not None:
            self._run.release()
        if self.output_config.summary and self.last_step is not None:
            rank_zero_info(self.summary_table())
        # Drawn at the end unless the schedule drew these very columns on the last sampled step.
        every, last = self.output_config.heatmap_every_n_steps, self.last_step
        drawn = every is not None and last is not None and last % every == 0
        errors = [] if drawn else self._draw_heatmaps(trainer)
        if self.last_step is not None and not self.findings and not self.trips:
            text = f"No findings: every rule stayed silent on every sampled step up to step {self.last_step}."
            errors += write_all_clear(trainer.loggers, self.prefix, self.last_step, text)
        self._raise_first(errors)

    def summary_table(self) -> str:
        """The end-of-fit table: the last sampled step's values per layer in depth order, findings marked."""
        marks: dict[str, list[str]] = {}
        for finding in self.last_findings:
            marks.setdefault(finding.layer, []).append(finding.rule)
        values = values_from_metrics(self.last_metrics, self.prefix)
        title = f"LayerHealthCallback: step {self.last_step}, {plural(len(self.last_findings), 'finding')}"
        return format_step_table(values, self.execution_order, marks, title)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove every hook and release the device state."""
        self._stage = None
        self._release_fit()

    def _release_fit(self) -> None:
        """Drop everything the fit created: the one place every exit goes through, so that no module or tensor stays."""
        run, self._run = self._run, None
        if run is not None:
            run.release()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the configuration and results, not the LightningModule.

        Lightning binds the LightningModule's ``log``/``log_dict`` onto every callback at each fit (and again at the
        next): pickling them would drag in the whole model, and fail on one that does not pickle.
        """
        return {name: value for name, value in self.__dict__.items() if name not in ("log", "log_dict")}

    @override
    def state_dict(self) -> dict[str, Any]:
        """Checkpointed state, plain Python values only: results, alerts, notes given, the sentinel's baseline."""
        diagnosis = self._diagnosis.state_dict()
        # The keys and their order are those of every checkpoint written so far.
        return {
            "last_metrics": dict(self.last_metrics),
            "last_step": self.last_step,
            "warned": sorted(self._warned),
            "alerts": diagnosis["alerts"],
            "findings": [vars(f) for f in self.findings],
            "trips": [vars(t) for t in self.trips],
            "sentinel": self._sentinel.state_dict(),
            "last_finite": diagnosis["last_finite"],
            "history": diagnosis["history"],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, when a fit resumes from it (or when called outside a Trainer).

        ``validate``, ``test`` and ``predict`` with a ``ckpt_path`` leave the state alone: Lightning restores callback
        state in every stage, and the checkpoint (``"best"`` is usually older than the end of the fit) would
        replace the findings, trips and last values of the fit that just ran.
        """
        if self._stage is not None and self._stage != "fit":
            return
        self.last_metrics = dict(state_dict.get("last_metrics", {}))
        self.last_step = state_dict.get("last_step")
        self._warned = set(state_dict.get("warned", []))
        self._diagnosis.load_state_dict(state_dict, self.prefix)
        self.findings = [Finding(**f) for f in state_dict.get("findings", [])]
        self.trips = [Trip(**t) for t in state_dict.get("trips", [])]
        if state_dict.get("sentinel"):
            self._sentinel.load_state_dict(state_dict["sentinel"])

    # ------------------------------------------------------------------------------------------------ internals
    def _fit_config(self) -> FitConfig:
        """What this fit starts from: the settings as they are now, so that a change made after construction holds.

        The groups' fields are stored resolved; resolving them again is what gives them their resolved types.
        """
        measure = self.measure_config
        return FitConfig(
            every_n_steps=self.every_n_steps,
            layers=self.layers,
            layer_types=import_types(measure.layer_types, "MeasureConfig.layer_types"),
            exclude=self.exclude,
            stats=self.stats,
            prefix=self.prefix,
            dead_unit_types=import_types(measure.dead_unit_types, "MeasureConfig.dead_unit_types"),
            unit_dim=measure.unit_dim,
            histogram_every_n_steps=measure.histogram_every_n_steps,
            histogram_bins=measure.histogram_bins,
            precision_targets=resolve_targets(measure.precision_targets),
            output_layer=measure.output_layer,
            sentinel_grads=self.sentinel_config.mode == "loss+grads",
            rules=frozenset(r.name for r in self._diagnosis.enabled),  # extension rules included
            charts=self.output_config.charts,
            fast_path=measure.fast_path,
        )

    def _start_fresh(self) -> None:
        """Forget earlier fits' results and memory: a new model with the same bug is warned about again.

        New containers, not cleared ones: a reference kept to the previous fit's ``findings`` still holds them.
        """
        self.last_metrics = {}
        self.last_step = None
        self.execution_order = []
        self.findings = []
        self.last_findings = []
        self.trips = []
        self._warned = set()  # the keys of the one-time notes already given
        # The rules' memory between sampled steps; checkpointed.
        self._diagnosis = Diagnosis(self.rule_config, every_rule(self.extensions))
        self._writer = FindingsWriter(self.prefix)  # findings and trips into the loggers, once each
        # The heatmaps' columns, per statistic: (step, {layer: value}); not checkpointed (a resumed fit draws from
        # the steps it sampled).
        self._heatmap = {}
        self._sentinel.load_state_dict({})  # no baseline, no trip (on_fit_start forgets what was observed)

    def _close_past(self, trainer: pl.Trainer, run: FitRun) -> None:
        """Finish the window of an optimizer step that is over, and forget its micro-batches."""
        self._finish(trainer, run.close_past(trainer.global_step, self.execution_order))

    def _note(self, note: Note | None) -> None:
        """Give a one-time note (a warning, or an info line), once per key over the run and its checkpoints."""
        if note is None or note.key in self._warned:
            return
        self._warned.add(note.key)
        if note.info:
            rank_zero_info(note.message)
        else:
            rank_zero_warn(note.message, category=LayerHealthWarning)

    def _finish(self, trainer: pl.Trainer, observed: ObservedStep | None) -> None:
        """Diagnose and log the collected window ``observed`` (``None``: none closed), then act as ``on_anomaly`` says.

        The rules run before anything is logged, so that the step's scalars (with the count of its findings) are one
        row in every logger; what the rules found reaches the loggers before ``on_anomaly`` acts, so that a run stopped
        by a :class:`~lightning_hookdiag.LayerHealthError` shows why in its dashboard. A logger's error is raised last.
        """
        if observed is None or (run := self._run) is None:
            return
        self.execution_order = observed.forward_order
        metrics, seen, notes = run.results(observed)
        for note in notes:
            self._note(note)
        findings, new = self._diagnosis.step(seen)
        self.last_findings = findings
        self.findings.extend(new)
        self.last_metrics, self.last_step = metrics, observed.step
        # One row per sampled step in every logger: the statistics with the count of the step's findings (the summary
        # group's alerts_active; last_metrics keeps the statistics only).
        active = {step_key(self.prefix, ALERTS_ACTIVE): float(len(findings))}
        errors = self._log(trainer, observed.step, {**metrics, **active})
        if observed.histogram_edges is not None:
            errors += self._log_histograms(trainer, observed, run)
        trips = [observed.trip] if observed.trip is not None else []  # with the findings of its window
        errors += self._writer.write(trainer.loggers, observed.step, new, trips)
        self._remember_heatmap_column(observed.step, seen.values)
        every = self.output_config.heatmap_every_n_steps
        if every is not None and observed.step % every == 0:
            errors += self._draw_heatmaps(trainer)
        try:
            if self.on_anomaly == "raise" and findings:
                raise LayerHealthError(format_error(findings))
            if self.on_anomaly in ("warn", "stop"):
                for finding in new:
                    rank_zero_warn(f"LayerHealthCallback: {finding.message}", category=LayerHealthWarning)
            if self.on_anomaly == "stop" and findings:
                trainer.should_stop = True
        finally:
            self._raise_first(errors)  # the other loggers and on_anomaly got the step first

    @staticmethod
    def _raise_first(errors: list[BaseException]) -> None:
        """Raise the first of the loggers' errors (each logger got its share before)."""
        if errors:
            raise errors[0]

    def _remember_heatmap_column(self, step: int, values: Mapping[str, Mapping[str, float]]) -> None:
        """Keep the step's values of the heatmap statistics (the latest ``HEATMAP_COLUMNS`` sampled steps)."""
        for stat in self.output_config.heatmap_stats:
            if stat in values:
                column = self._heatmap.setdefault(stat, deque(maxlen=HEATMAP_COLUMNS))
                column.append((step, dict(values[stat])))

    def _draw_heatmaps(self, trainer: pl.Trainer) -> list[BaseException]:
        """Draw each kept statistic as layers (forward order) by sampled steps into the loggers that store images.

        Layers that ran on none of the drawn steps are left out; a layer without a value on a step is a missing cell.
        """
        errors: list[BaseException] = []
        for stat, columns in self._heatmap.items():
            seen = {layer for _, by_layer in columns for layer in by_layer}
            rows = [layer for layer in self.execution_order if layer in seen]
            rows += sorted(seen - set(rows))  # parameters and layers not in the last forward order
            matrix = [[by_layer.get(layer) for _, by_layer in columns] for layer in rows]
            signed = any(v is not None and v < 0 for row in matrix for v in row)  # NaN is neither: drawn red
            scale: Literal["log", "linear"] = "linear" if signed else "log"
            # Cells of 4 to 32 pixels, so that a few layers or steps still make an image a person can read.
            cell = max(4, min(32, 384 // max(len(rows), len(columns))))
            image = render(matrix, scale=scale, cell=cell)
            step = columns[-1][0]
            errors += write_image(trainer.loggers, f"{self.prefix}_heatmap/{stat}", image, step)
        # A logger whose images need a package that is missing (W&B without Pillow) is said once, not raised: the
        # rest of its logs are whole, and the fit must not fail at its end for want of a picture.
        for missing in [e for e in errors if isinstance(e, MissingExtraError)]:
            self._note(Note(f"image:{missing}", f"LayerHealthCallback: the heatmap is not drawn there: {missing}"))
        return [e for e in errors if not isinstance(e, MissingExtraError)]

    def _log(self, trainer: pl.Trainer, step: int, metrics: dict[str, float]) -> list[BaseException]:
        """Send the step's metrics to every logger; returns the loggers' errors, raised later."""
        errors: list[BaseException] = []
        for logger in trainer.loggers:
            try:
                logger.log_metrics(metrics, step=step)
            except Exception as error:  # the other loggers and the rules still get the step; raised after them
                errors.append(error)
        return errors

    def _log_histograms(self, trainer: pl.Trainer, observed: ObservedStep, run: FitRun) -> list[BaseException]:
        """Send the step's histograms to the loggers that store them; returns the loggers' errors."""
        writers = [(logger, _histogram_writer(logger)) for logger in trainer.loggers]
        writes = [write for _, write in writers if write is not None]
        skipped = [type(logger).__name__ for logger, write in writers if write is None]
        errors: list[BaseException] = []
        if writes:  # cut into series only for a logger that stores them
            histograms = run.histograms(observed)
            for write in writes:
                try:
                    for key, counts in histograms.series:
                        write(key, counts, histograms.left, histograms.right, observed.step)
                except Exception as error:  # as in _log: the other loggers and the rules first
                    errors.append(error)
        self._note(histogram_note(skipped))
        return errors
