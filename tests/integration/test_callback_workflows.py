"""Everyday Lightning workflows with the callback in the Trainer (issue 29), each on real Trainers.

A GAN's two optimizer steps per batch, fit then ``test``/``validate``/``predict`` from the best checkpoint, a callback
reused for a second fit, Trainers without a logger, and the configuration a user writes.
"""

from __future__ import annotations

import logging
import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import RecordingLogger, TinyModule, by_name, count_hooks, force_trips, make_data, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, TensorDataset

import lightning_hookdiag
from lightning_hookdiag import LayerHealthCallback, LayerHealthWarning, RuleConfig
from lightning_hookdiag._vocabulary import SUMMARIES

P = "layer_health"


# ------------------------------------------------------------------------------------------ two steps per batch
class GAN(pl.LightningModule):
    """A tiny GAN under manual optimization: a discriminator step, then a generator step, in every batch.

    Records, per batch, what the callback should log: the batch's first optimizer step, each optimizer's parameters
    and gradients at its own step, and every output and output gradient of ``d.0`` (the discriminator runs three
    times per batch: real, detached fake, fake).
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
        self.d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.truth: dict[int, dict[str, float]] = {}

    def discriminate(self, x: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
        h = self.d[0](x)
        if h.requires_grad:
            h.retain_grad()
        outputs.append(h)
        return self.d[2](self.d[1](h))

    def training_step(self, batch, batch_idx):
        real, z = batch
        opt_g, opt_d = self.optimizers()
        first = self.global_step
        bce = nn.functional.binary_cross_entropy_with_logits
        outputs: list[torch.Tensor] = []
        truth: dict[str, float] = {}

        fake = self.g(z)
        d_loss = bce(self.discriminate(real, outputs), torch.ones(len(real), 1))
        d_loss = d_loss + bce(self.discriminate(fake.detach(), outputs), torch.zeros(len(z), 1))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self._measure(truth, "d.0.weight", self.d[0].weight, opt_d)

        g_loss = bce(self.discriminate(fake, outputs), torch.ones(len(z), 1))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self._measure(truth, "g.0.weight", self.g[0].weight, opt_g)

        every = torch.cat([h.detach().reshape(-1) for h in outputs]).double()
        truth["act_mean/d.0"] = every.mean().item()
        grads = [h.grad.double() for h in outputs if h.grad is not None]
        truth["act_grad_norm/d.0"] = math.sqrt(sum((g**2).sum().item() for g in grads))
        self.truth[first] = truth

    @staticmethod
    def _measure(truth: dict[str, float], name: str, weight: nn.Parameter, optimizer) -> None:
        before = weight.detach().clone().double()
        truth[f"param_norm/{name}"] = before.norm().item()
        truth[f"param_grad_norm/{name}"] = weight.grad.double().norm().item()
        optimizer.step()
        truth[f"param_update_ratio/{name}"] = (weight.detach().double() - before).norm().item() / before.norm().item()

    def configure_optimizers(self):
        return torch.optim.Adam(self.g.parameters(), lr=1e-2), torch.optim.SGD(self.d.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(96, 4, generator=g), torch.randn(96, 2, generator=g)), batch_size=8)


def test_a_gan_with_two_optimizer_steps_per_batch_is_sampled_once_every_n_optimizer_steps(caplog):
    logger = RecordingLogger()
    module = GAN()
    callback = LayerHealthCallback(every_n_steps=3, output={"summary": False})
    with caplog.at_level(logging.INFO):
        make_trainer([callback], max_steps=24, logger=logger).fit(module)
    # Batches start at steps 0, 2, 4, ...: steps 0, 6, 12, 18 start one; 3, 9, 15, 21 fall inside the one before
    # and are observed on the next batch, logged at its first step. Before: 0, 6, 12, 18 only.
    steps = [s for s, _ in logger.ours()]
    assert steps == [0, 4, 6, 10, 12, 16, 18, 22]
    for step, metrics in logger.ours():
        truth = module.truth[step]
        for key, value in truth.items():
            assert metrics[f"{P}/{key}"] == pytest.approx(value, rel=1e-5), (step, key)
    notes = [r.getMessage() for r in caplog.records if "fell inside a training batch" in r.getMessage()]
    assert len(notes) == 1  # once per fit
    assert "optimizer step 3 (every_n_steps=3)" in notes[0]
    assert "logged at its first optimizer step, 4" in notes[0]
    assert count_hooks(module) == 0


def test_one_optimizer_step_per_batch_never_catches_up(caplog):
    logger = RecordingLogger()
    with caplog.at_level(logging.INFO):
        make_trainer(
            [LayerHealthCallback(every_n_steps=3, output={"summary": False})], max_steps=10, logger=logger
        ).fit(TinyModule(data=make_data(n=80)))
    assert [s for s, _ in logger.ours()] == [0, 3, 6, 9]
    assert "fell inside a training batch" not in caplog.text


# --------------------------------------------------------------------------- fit, then evaluate a checkpoint
class GoesSick(TinyModule):
    """Healthy until step 8, when every unit of the first ReLU dies; validated every 2 steps on a score that is best
    at step 4, tested and predicted on the training data."""

    def __init__(self) -> None:
        super().__init__(data=make_data(n=128))
        self.on_step = self.sicken

    @staticmethod
    def sicken(module: TinyModule, batch_idx: int) -> None:
        if module.global_step == 8:
            with torch.no_grad():
                module.model[0].bias.fill_(-100.0)

    def validation_step(self, batch, batch_idx):
        self.log("score", float(abs(self.global_step - 4)))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", self.loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=64)

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


def fit_until_sick(tmp_path, monkeypatch) -> tuple[LayerHealthCallback, pl.Trainer, GoesSick]:
    # A trip early (step 1), to be found in the best checkpoint as well.
    callback = LayerHealthCallback(
        every_n_steps=2, on_anomaly="ignore", sentinel=force_trips({1}), output={"summary": False}
    )
    best = ModelCheckpoint(dirpath=tmp_path, monitor="score", mode="min")
    module = GoesSick()
    trainer = make_trainer(
        [callback, best], max_steps=11, enable_checkpointing=True, val_check_interval=2, limit_val_batches=1
    )
    trainer.fit(module)
    return callback, trainer, module


def results(callback: LayerHealthCallback) -> tuple:
    return list(callback.findings), list(callback.trips), dict(callback.last_metrics), callback.last_step


@pytest.mark.parametrize("stage", ["test", "validate", "predict"])
def test_evaluating_the_best_checkpoint_after_fit_keeps_the_fits_results(tmp_path, monkeypatch, stage):
    callback, trainer, module = fit_until_sick(tmp_path, monkeypatch)
    after_fit = results(callback)
    findings, trips, last_metrics, last_step = after_fit
    assert last_step == 10
    assert [(t.step, t.kind) for t in trips] == [(1, "loss_spike")]
    assert {(f.rule, f.step) for f in findings} >= {("loss_spike", 1), ("dead_units", 8)}
    # The best checkpoint holds an older state: it would replace the fit's results.
    saved = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    state = saved["callbacks"][callback.state_key]
    assert state["last_step"] < 8
    assert not any(f["rule"] == "dead_units" for f in state["findings"])
    dead_frac = f"{P}/act_dead_frac/model.1"
    assert by_name(state["last_metrics"])[dead_frac] != by_name(last_metrics)[dead_frac]

    if stage == "predict":
        trainer.predict(module, ckpt_path="best")
    else:
        getattr(trainer, stage)(module, ckpt_path="best", verbose=False)
    assert results(callback) == after_fit
    assert count_hooks(module) == 0


@pytest.mark.parametrize("same", [False, True], ids=["new callback", "same callback"])
def test_a_fit_resumed_from_the_best_checkpoint_still_restores_its_state(tmp_path, monkeypatch, same):
    callback, trainer, _ = fit_until_sick(tmp_path, monkeypatch)
    trainer.test(ckpt_path="best", verbose=False)
    path = trainer.checkpoint_callback.best_model_path
    saved = torch.load(path, weights_only=False)["callbacks"][callback.state_key]
    # The same object rolls back to the checkpoint like a new one: its later findings (step 8) are not this run's
    resumed = callback if same else LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False})
    logger = RecordingLogger()
    # Resumed at step 4 and stopped at 6, before the model goes sick: what it holds of steps 0-3 is the checkpoint's.
    make_trainer([resumed], max_steps=6, logger=logger).fit(GoesSick(), ckpt_path=path)
    assert [s for s, _ in logger.ours()] == [4]
    assert [(t.step, t.kind) for t in resumed.trips] == [(1, "loss_spike")]  # restored: step 1 never ran here
    assert [vars(f) for f in resumed.findings[: len(saved["findings"])]] == saved["findings"]
    assert not any(f.rule == "dead_units" for f in resumed.findings)


# ------------------------------------------------------------------------------------ a callback used twice
def dead_module() -> TinyModule:
    module = TinyModule(data=make_data(n=32))
    with torch.no_grad():
        module.model[0].bias.fill_(-100.0)  # every unit of model.1 (a ReLU) dead from the start
    return module


def test_a_callback_reused_for_a_second_fresh_fit_warns_again_and_keeps_only_that_fits_results():
    callback = LayerHealthCallback(every_n_steps=2, output={"summary": False})
    with pytest.warns(LayerHealthWarning) as first:
        make_trainer([callback], max_steps=3).fit(dead_module())
    first_findings = callback.findings
    found = [(f.rule, f.layer, f.step) for f in first_findings]
    assert ("dead_units", "model.1", 0) in found
    # A new model with the same bug, a new Trainer, no checkpoint: before, the alert memory kept it silent.
    with pytest.warns(LayerHealthWarning) as second:
        make_trainer([callback], max_steps=3).fit(dead_module())

    def rules(caught) -> list[str]:  # "LayerHealthCallback: dead_units at step 0: ..." -> "dead_units"
        return [str(w.message).split(": ")[1].split(" at step")[0] for w in caught if w.category is LayerHealthWarning]

    assert rules(first) == rules(second)
    assert sum("dead_units" in str(w.message) for w in second) == 1
    assert [(f.rule, f.layer, f.step) for f in callback.findings] == found  # that fit's findings only
    assert callback.findings is not first_findings  # a reference to the first fit's findings still holds them
    assert [(f.rule, f.layer, f.step) for f in first_findings] == found


def test_a_second_fit_of_the_same_trainer_goes_on_and_keeps_the_memory():
    callback = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore", output={"summary": False})
    module = dead_module()
    trainer = make_trainer([callback], max_steps=3)
    trainer.fit(module)
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(module)  # goes on from step 3: the same training, the same condition, no new alert
    assert [(f.rule, f.step) for f in callback.findings if f.rule == "dead_units"] == [("dead_units", 0)]
    assert callback.last_step == 4


# ----------------------------------------------------------------------------------------- no logger at all
@pytest.mark.parametrize("trainer_kwargs", [{"logger": False}, {"barebones": True}], ids=["logger=False", "barebones"])
def test_without_a_logger_the_callback_says_so_once_and_keeps_its_findings(caplog, trainer_kwargs):
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    with caplog.at_level(logging.INFO):
        make_trainer([callback], max_steps=3, **trainer_kwargs).fit(dead_module())
    notes = [r.getMessage() for r in caplog.records if "has no logger" in r.getMessage()]
    assert len(notes) == 1
    assert "no statistic is logged" in notes[0]
    assert "callback.last_metrics" in notes[0]
    assert callback.last_step == 2
    assert by_name(callback.last_metrics)[f"{P}/act_dead_frac/model.1"] == 1.0
    assert [(f.rule, f.step) for f in callback.findings if f.rule == "dead_units"] == [("dead_units", 0)]


def test_with_a_logger_nothing_is_said_about_loggers(caplog):
    with caplog.at_level(logging.INFO):
        make_trainer(
            [LayerHealthCallback(every_n_steps=1, output={"summary": False})], max_steps=2, logger=RecordingLogger()
        ).fit(TinyModule())
    assert "has no logger" not in caplog.text


# -------------------------------------------------------------------------------- the configuration a user writes
def test_rules_take_a_rule_config_as_well_as_a_mapping():
    config = RuleConfig(enabled=["dead_units"], dead_frac_threshold=0.5)
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", rules=config, output={"summary": False})
    assert callback.rule_config is config
    assert LayerHealthCallback(rules={"enabled": ["dead_units"], "dead_frac_threshold": 0.5}).rule_config == config
    module = TinyModule(data=make_data(n=32))
    with torch.no_grad():
        module.model[0].bias[:5].fill_(-100.0)  # 5 of 8 units dead: above 0.5, below the default 0.9
    make_trainer([callback], max_steps=1).fit(module)
    assert [(f.rule, f.layer) for f in callback.findings] == [("dead_units", "model.1")]


def test_extra_stats_add_to_the_default_set_and_are_measured():
    logger = RecordingLogger()
    module = TinyModule(data=make_data(n=32))
    # charts="all": the per-layer non-finite counts of ALL_STATS are logged although they are 0.
    callback = LayerHealthCallback(
        every_n_steps=4, measure={"extra_stats": ["act_kurtosis"]}, output={"summary": False, "charts": "all"}
    )
    assert callback.stats == (*lightning_hookdiag.ALL_STATS, "act_kurtosis")
    make_trainer([callback], max_steps=1, logger=logger).fit(module)
    ((step, metrics),) = logger.ours()
    summaries = {f"{stat}_{kind}" for stat, kinds in SUMMARIES.items() for kind in kinds}
    assert summaries <= {k.split("/")[1] for k in metrics}  # the summary group, beside the statistics
    logged = {k.split("/")[1] for k in metrics} - summaries
    # The precursors that do not apply to this model are not logged: no attention call (attn_logit_max), and a
    # regression head of one output, whose log Z is the logit itself (logit_lse_mean).
    assert logged == {*lightning_hookdiag.ALL_STATS, "act_kurtosis"} - {"attn_logit_max", "logit_lse_mean"}
    _, x, _, weights = module.record[0]
    out = module.reference_model(weights)[0](x).double()
    centred = out - out.mean()
    kurtosis = (centred**4).mean() / (centred**2).mean() ** 2
    assert metrics[f"{P}/act_kurtosis/model.0"] == pytest.approx(kurtosis.item(), rel=1e-5)
    # stats= stays the whole list; extra_stats adds to it.
    both = LayerHealthCallback(stats=["act_mean"], measure={"extra_stats": ["act_kurtosis", "act_mean"]})
    assert both.stats == ("act_mean", "act_kurtosis")


@pytest.mark.parametrize(
    ("kwargs", "facts"),
    [
        (
            {"measure": {"extra_stats": ["act_kurtosis", "act_kurt"]}},
            ["MeasureConfig.extra_stats", "unknown statistic(s) ['act_kurt']", "act_absmax"],
        ),
        ({"measure": {"extra_stats": 3}}, ["MeasureConfig.extra_stats", "got 3"]),
        ({"measure": {"extra_stats": [None]}}, ["MeasureConfig.extra_stats", "got [None]"]),
        ({"stats": ["act_meen"], "measure": {"extra_stats": ["act_kurtosis"]}}, ["stats", "act_meen", "act_kurtosis"]),
        ({"rules": RuleConfig}, ["rule settings", "RuleConfig"]),
    ],
)
def test_bad_statistics_and_rules_name_the_argument_and_the_valid_values(kwargs, facts):
    with pytest.raises(ValueError, match=facts[0]) as excinfo:
        LayerHealthCallback(**kwargs)
    for fact in facts:
        assert fact in str(excinfo.value)


def test_the_documented_names_are_exported():
    assert lightning_hookdiag.PRECURSOR_STATS == ("attn_logit_max", "logit_lse_mean", "logit_absmax")
    assert {"PRECURSOR_STATS", "Trip"} <= set(lightning_hookdiag.__all__)  # a trip's type: the next test


def test_the_elements_of_trips_are_the_exported_type(monkeypatch):
    callback = LayerHealthCallback(
        every_n_steps=10, on_anomaly="ignore", sentinel=force_trips({1}), output={"summary": False}
    )
    make_trainer([callback], max_steps=3).fit(TinyModule())
    assert [type(t) for t in callback.trips] == [lightning_hookdiag.Trip]


def test_numpy_integers_are_accepted_wherever_an_integer_is():
    logger = RecordingLogger()
    callback = LayerHealthCallback(
        every_n_steps=np.int64(3),
        rules={"dead_frac_threshold": np.float32(0.5)},
        sentinel={"window": np.int64(30)},
        measure={"histogram_every_n_steps": np.int32(6), "histogram_bins": np.int64(8), "unit_dim": np.int64(-1)},
        output={"summary": False},
    )
    assert (type(callback.every_n_steps), type(callback.histogram_bins), type(callback.unit_dim)) == (int, int, int)
    assert type(callback.sentinel_config.window) is int
    make_trainer([callback], max_steps=7, logger=logger).fit(TinyModule(data=make_data(n=64)))
    assert [s for s, _ in logger.ours()] == [0, 3, 6]


@pytest.mark.parametrize(
    ("kwargs", "facts"),
    [
        ({"every_n_steps": np.float64(5.0)}, ["every_n_steps", "an integer >= 1", "5.0"]),
        ({"every_n_steps": np.bool_(True)}, ["every_n_steps", "True"]),
        ({"every_n_steps": np.int64(0)}, ["every_n_steps", "an integer >= 1", "np.int64(0)"]),
        ({"rules": {"trend_window": np.float32(4)}}, ["trend_window", "an integer >= 3"]),
    ],
)
def test_numbers_that_are_not_integers_are_still_rejected(kwargs, facts):
    with pytest.raises(ValueError, match=facts[0]) as excinfo:
        LayerHealthCallback(**kwargs)
    for fact in facts:
        assert fact in str(excinfo.value)


# ------------------------------------------------------------------------------------- reparametrised weights
class Double(nn.Module):
    """A parametrization: the layer computes with twice the parameter it holds."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_pruned_weights_are_logged_under_the_name_of_the_parameter_measured():
    logger = RecordingLogger()
    module = TinyModule(data=make_data(n=32))  # 4 batches an epoch; ModelPruning prunes when epoch 0 ends
    prune = ModelPruning("l1_unstructured", amount=0.5, make_pruning_permanent=False, verbose=0)
    make_trainer(
        [prune, LayerHealthCallback(every_n_steps=1, output={"summary": False})], max_steps=6, logger=logger
    ).fit(module)
    by_step = dict(logger.ours())
    records = {step: weights for step, _, _, weights in module.record}
    for step in (0, 3):  # before pruning: the layer computes with model.0.weight itself
        assert by_step[step][f"{P}/param_norm/model.0.weight"] == pytest.approx(records[step]["0.weight"].norm().item())
    for step in (4, 5):  # after: with weight_orig * weight_mask; weight_orig is the parameter the optimizer steps
        assert f"{P}/param_norm/model.0.weight" not in by_step[step]
        weights = records[step]
        measured = by_step[step][f"{P}/param_norm/model.0.weight_orig"]
        assert measured == pytest.approx(weights["0.weight_orig"].norm().item(), rel=1e-6)
        effective = (weights["0.weight_orig"] * weights["0.weight_mask"]).norm().item()
        assert measured != pytest.approx(effective, rel=0.01)  # what the old key claimed to be, and was not


def test_a_parametrized_layer_is_observed_as_the_layer_and_its_parameter_under_its_own_name():
    logger = RecordingLogger()
    module = TinyModule(data=make_data(n=32))
    parametrize.register_parametrization(module.model[0], "weight", Double())
    callback = LayerHealthCallback(every_n_steps=2, output={"summary": False})
    make_trainer([callback], max_steps=1, logger=logger).fit(module)
    # The parametrization computes the weight; it is no layer of the network (before: it replaced model.0).
    assert callback.layer_names == ["model.0", "model.1", "model.2"]
    ((_, metrics),) = logger.ours()
    _, x, _, weights = module.record[0]
    original = weights["0.parametrizations.weight.original"].double()
    out = x.double() @ (2 * original).T + weights["0.bias"].double()
    assert metrics[f"{P}/act_mean/model.0"] == pytest.approx(out.mean().item(), rel=1e-5)
    key = f"{P}/param_norm/model.0.parametrizations.weight.original"
    assert metrics[key] == pytest.approx(original.norm().item(), rel=1e-6)
    assert not any(k.endswith("/model.0.weight") for k in metrics)
    assert count_hooks(module) == 0


def test_a_parametrization_registered_during_the_fit_renames_the_key_from_the_next_step():
    class Reparametrize(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                parametrize.register_parametrization(pl_module.model[0], "weight", Double())

    logger = RecordingLogger()
    module = TinyModule(data=make_data(n=32))
    weight = module.model[0].weight
    make_trainer(
        [Reparametrize(), LayerHealthCallback(every_n_steps=1, output={"summary": False})], max_steps=6, logger=logger
    ).fit(module)
    assert module.model[0].parametrizations.weight.original is weight  # the same parameter, moved
    names = {s: {k.split("/")[2] for k in m if k.startswith(f"{P}/param_norm/model.0.")} for s, m in logger.ours()}
    assert names[3] == {"model.0.weight", "model.0.bias"}
    assert names[4] == {"model.0.parametrizations.weight.original", "model.0.bias"}
