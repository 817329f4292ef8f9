"""Other callbacks around ours (issue 35): forwards other callbacks run, and two callbacks on one Trainer."""

import re

import lightning.pytorch as pl
import pytest
import torch
from helpers import RecordingLogger, TinyModule, count_hooks, depths, make_trainer
from torch import nn

from lightning_hookdiag import LayerHealthCallback

P = "layer_health"


class Probe(pl.Callback):
    """Runs the model on a fixed, large probe input (no grad) in one of its hooks, as evaluation callbacks do."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.calls = 0
        self.x = torch.full((3, 4), 100.0)

    def _probe(self, pl_module: pl.LightningModule) -> None:
        self.calls += 1
        with torch.no_grad():
            pl_module.model(self.x)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.hook == "on_train_batch_end":
            self._probe(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.hook == "on_train_batch_start":
            self._probe(pl_module)


def reference(module: TinyModule) -> dict[int, dict[str, float]]:
    """``act_absmax`` and ``act_mean`` of ``model.0`` per step, over that step's training micro-batches only."""
    outputs: dict[int, list[torch.Tensor]] = {}
    for step, x, _, weights in module.record:
        outputs.setdefault(step, []).append(module.reference_model(weights)[0](x).detach().double().reshape(-1))
    out = {}
    for step, parts in outputs.items():
        flat = torch.cat(parts)
        out[step] = {"act_absmax": flat.abs().max().item(), "act_mean": flat.mean().item()}
    return out


def fit(order: str, hook: str, accumulate: int) -> tuple[dict[int, dict[str, float]], TinyModule, Probe]:
    torch.manual_seed(0)
    module = TinyModule()
    logger = RecordingLogger()
    probe = Probe(hook)
    ours = LayerHealthCallback(
        every_n_steps=1, stats=["act_absmax", "act_mean"], on_anomaly="ignore", output={"summary": False}
    )
    callbacks = [probe, ours] if order == "before" else [ours, probe]
    make_trainer(callbacks, max_steps=3, logger=logger, accumulate_grad_batches=accumulate).fit(module)
    assert count_hooks(module) == 0
    return dict(logger.ours()), module, probe


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("order", ["before", "after"])
def test_a_forward_another_callback_runs_at_batch_end_is_not_counted_whatever_its_place(order, accumulate):
    metrics, module, probe = fit(order, "on_train_batch_end", accumulate)
    assert probe.calls == 3 * accumulate  # guards the test: the probe ran on every micro-batch
    expected = reference(module)
    assert sorted(metrics) == sorted(expected) == [0, 1, 2]
    for step, values in expected.items():
        for stat, value in values.items():
            assert metrics[step][f"{P}/{stat}/model.0"] == pytest.approx(value, rel=1e-6), (step, stat)


def test_the_results_do_not_depend_on_the_callback_order():
    before, _, _ = fit("before", "on_train_batch_end", 2)
    after, _, _ = fit("after", "on_train_batch_end", 2)
    assert before == after


def test_a_forward_another_callback_runs_at_batch_start_counts_only_after_ours_as_documented():
    # Lightning calls nothing between the callbacks' on_train_batch_start and training_step: a forward run there by a
    # callback listed after ours is part of the micro-batch (docs/integrations.md#what-a-sampled-step-records).
    before, module, _ = fit("before", "on_train_batch_start", 1)
    expected = reference(module)
    for step, values in expected.items():
        assert before[step][f"{P}/act_absmax/model.0"] == pytest.approx(values["act_absmax"], rel=1e-6)
    after, _, _ = fit("after", "on_train_batch_start", 1)
    assert after[0][f"{P}/act_absmax/model.0"] > 10 * expected[0]["act_absmax"]


class ProbeInTrainingStep(TinyModule):
    """Manual optimization with a forward after its optimizer step (a post-update look): the training step's own."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.after: list[tuple[int, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.record.append((self.global_step, x.clone(), y.clone(), weights))
        loss = self.loss(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        with torch.no_grad():
            self.after.append((self.global_step, self.model[0](x).detach().double().reshape(-1)))


def test_manual_optimization_counts_the_training_steps_forwards_after_its_optimizer_step():
    module = ProbeInTrainingStep()
    logger = RecordingLogger()
    callback = LayerHealthCallback(
        every_n_steps=1, stats=["act_absmax"], on_anomaly="ignore", output={"summary": False}
    )
    make_trainer([callback], max_steps=2, logger=logger).fit(module)
    metrics = dict(logger.ours())
    for step, x, _, weights in module.record:
        seen = [module.reference_model(weights)[0](x).detach().double().reshape(-1)]
        seen += [out for s, out in module.after if s == step + 1]  # global_step counts the step already
        expected = torch.cat(seen).abs().max().item()
        assert metrics[step][f"{P}/act_absmax/model.0"] == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------------------ two callbacks
def test_two_callbacks_with_the_same_prefix_are_an_error_at_fit_start_naming_both():
    module = TinyModule()
    first = LayerHealthCallback(every_n_steps=1, layers=["model.0"])
    second = LayerHealthCallback(every_n_steps=1, layers=["model.2"])
    with pytest.raises(ValueError, match=re.escape("prefix=")) as error:
        make_trainer([first, second], max_steps=1, logger=RecordingLogger()).fit(module)
    message = str(error.value)
    assert "'layer_health'" in message
    for part in ("callbacks[0]", "callbacks[1]", "['model.0']", "['model.2']"):
        assert part in message
    assert count_hooks(module) == 0


def test_two_callbacks_with_distinct_prefixes_log_apart_with_their_own_depths():
    module = TinyModule(model=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    logger = RecordingLogger()
    first = LayerHealthCallback(every_n_steps=1, layers=["model.0"], on_anomaly="ignore", output={"summary": False})
    second = LayerHealthCallback(
        every_n_steps=1, layers=["model.2"], prefix="head_health", on_anomaly="ignore", output={"summary": False}
    )
    make_trainer([first, second], max_steps=1, logger=logger).fit(module)
    merged: dict[str, float] = {}
    for step, metrics in logger.raw:
        assert step == 0
        assert not set(merged) & set(metrics)  # no key written twice at the step
        merged.update(metrics)
    # Each callback numbers its own layers: the first one it observes is at depth 0.
    assert depths(merged) == {"model.0": 0}
    assert depths(merged, "head_health") == {"model.2": 0}
    assert merged[f"{P}/grad_norm_total"] != merged["head_health/grad_norm_total"]
