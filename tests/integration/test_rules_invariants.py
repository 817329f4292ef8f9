"""Invariants every healthy run keeps (issue 38 items 3 and 6), on real Trainer fits: each bug and its fixed twin.

``input_scale`` on the small side (inputs far below unit scale), ``shared_parameters`` (a parameter held by two
optimizers, or twice by one; a GAN's generator optimizer built from ``self.parameters()``) and
``scheduler_overstepped`` (an LR scheduler stepped by the user as well as by Lightning). The zoo and every fixed twin of
``tests/bugs`` stay silent (``test_rules_zoo.py``, ``test_bugs.py``); Lightning's demo transformer is checked here.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from cases import BugModule, Case, Fit, _data, _mlp, run
from helpers import make_trainer, run_rules
from lightning.pytorch.demos.transformer import LightningTransformer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.rules import ParamFacts, RuleConfig, values_from_metrics

NEW_RULES = ("input_scale", "shared_parameters", "scheduler_overstepped")


def _hits(callback: LayerHealthCallback, rule: str) -> list[Any]:
    return [f for f in callback.findings if f.rule == rule]


# ------------------------------------------------------------------------------- input_scale: the small side
def _features(n: int, d_in: int, scale: float, seed: int = 0) -> TensorDataset:
    """Features uniform in [0, 1) times ``scale``, with a learnable binary label."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d_in, generator=g)
    y = (x[:, : d_in // 2].sum(1) > x[:, d_in // 2 :].sum(1)).long()
    return TensorDataset(x * scale, y)


def _divided_twice(sick: bool) -> Fit:
    # The bug: pixels already in [0, 1] (ToTensor) divided by 255 again in the Dataset.
    scale = 1 / 255 if sick else 1.0
    return Fit(BugModule(_mlp(64, 32, d_out=2), _features(64, 64, scale), loss="ce", lr=0.01))


def _tiny_mask_conv(sick: bool) -> Fit:
    # The bug: a "soft mask" input stored as 1e-6 for on (meant 1), fed to a small CNN.
    g = torch.Generator().manual_seed(0)
    masks = (torch.rand(64, 1, 12, 12, generator=g) > 0.5).float()
    labels = (masks[:, 0, :6].sum((1, 2)) > masks[:, 0, 6:].sum((1, 2))).long()
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 12 * 12, 2))
    return Fit(BugModule(net, TensorDataset(masks * (1e-6 if sick else 1.0), labels), loss="ce", lr=0.01))


def _flatten_first(sick: bool) -> Fit:
    # An MNIST-style MLP that starts with nn.Flatten: the Linear after it reads the inputs.
    g = torch.Generator().manual_seed(0)
    images = torch.rand(64, 1, 8, 8, generator=g) / (255 if sick else 1)
    labels = (images.flatten(1)[:, :32].sum(1) > images.flatten(1)[:, 32:].sum(1)).long()
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
    return Fit(BugModule(net, TensorDataset(images, labels), loss="ce", lr=0.01))


SMALL_INPUTS = [
    Case("divided_by_255_twice", "features in [0, 1/255]", _divided_twice, "input_scale", "model.0", 3, step=0),
    Case("mask_of_1e-6", "a binary mask stored as 1e-6", _tiny_mask_conv, "input_scale", "model.0", 3, step=0),
    Case("flatten_then_tiny", "Flatten, then features in [0, 1/255]", _flatten_first, "input_scale", "model.1", 3),
]


@pytest.mark.parametrize("case", SMALL_INPUTS, ids=lambda c: c.name)
def test_inputs_far_too_small_are_reported_at_the_first_weighted_layer(case):
    callback = run(case, sick=True)
    (hit,) = _hits(callback, "input_scale")
    assert (hit.layer, hit.step, hit.stat, hit.phase) == (case.layer, 0, "param_grad_norm", "backward")
    assert hit.threshold == 0.1
    assert hit.value < 0.1
    assert "far below unit scale" in hit.message


@pytest.mark.parametrize("case", SMALL_INPUTS, ids=lambda c: c.name)
def test_the_fixed_twins_of_small_inputs_raise_nothing(case):
    callback = run(case, sick=False)
    assert [f.message for f in callback.findings] == []


def test_the_small_side_estimate_is_the_gradient_ratio_and_tracks_the_true_input_norm():
    # The finding's value against an independent computation: the same first batch through a copy of the model.
    case = SMALL_INPUTS[0]
    callback = run(case, sick=True, max_steps=1)
    (hit,) = _hits(callback, "input_scale")
    torch.manual_seed(0)
    fit = case.build(True)
    x, y = next(iter(fit.module.train_dataloader()))
    first = fit.module.model[0]
    out = first(x)
    out.retain_grad()
    F.cross_entropy(fit.module.model[1:](out), y).backward()
    assert first.weight.grad is not None
    assert out.grad is not None
    expected = float(first.weight.grad.double().norm() / out.grad.double().norm())
    assert hit.value == pytest.approx(expected, rel=1e-5)
    # And it estimates what it claims: the RMS norm of the input rows, within a factor of 3 (here ~0.018).
    true_norm = float(x.double().pow(2).sum(1).mean().sqrt())
    assert true_norm / 3 < hit.value < true_norm * 3


def _one_hot(sick: bool) -> Fit:
    # Healthy sparse inputs: one-hot rows over 4096 categories (RMS 0.016, norm 1) and L2-normalised bag-of-words.
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (64,), generator=g)
    x = F.one_hot(ids, 4096).float() if sick else F.normalize(torch.rand(64, 4096, generator=g) ** 8, dim=1)
    return Fit(BugModule(_mlp(4096, 16, d_out=2), TensorDataset(x, (ids % 2).long()), loss="ce", lr=0.01))


@pytest.mark.parametrize("one_hot", [True, False], ids=["one_hot_4096", "l2_normalised_rows"])
def test_one_hot_and_l2_normalised_inputs_are_not_too_small(one_hot):
    # Their RMS is far below 1 (1/64 for a one-hot over 4096), but each row has norm 1: the rule reads the norm.
    case = Case("sparse", "", _one_hot, None, None, 3)
    callback = run(case, sick=one_hot, rules={"enabled": ["input_scale"]})
    assert [f.message for f in callback.findings] == []


# ------------------------------------------------------------------------------- the optimizers as a whole
class _Gan(pl.LightningModule):
    """A tiny GAN under manual optimization; ``whole``: the generator's optimizer holds ``self.parameters()``."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.whole = whole
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        noise = torch.randn(real.shape[0], 4)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        fake = self.generator(noise)
        d_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(real), ones
        ) + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> Any:
        g_params = self.parameters() if self.whole else self.generator.parameters()
        return torch.optim.Adam(g_params, lr=1e-3), torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g) + 2.0), batch_size=8)


def _fit(module: pl.LightningModule, steps: int, **callback: Any) -> LayerHealthCallback:
    torch.manual_seed(0)
    cb = LayerHealthCallback(**{"every_n_steps": 1, "on_anomaly": "ignore", "output": {"summary": False}, **callback})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer([cb], max_steps=steps).fit(module)
    return cb


def test_a_gan_generator_optimizer_built_from_self_parameters_is_reported():
    callback = _fit(_Gan(whole=True), steps=6)
    (hit,) = _hits(callback, "shared_parameters")
    # The discriminator's 4 parameters are held by both optimizers; the first in forward order owns the finding.
    assert hit.layer == "discriminator.0"
    assert hit.value == 4
    assert hit.step == 0
    assert "discriminator.0.weight by optimizers 0 and 1" in hit.message
    assert "optimizer 0 holds every parameter of the model" in hit.message


def test_a_gan_with_one_optimizer_per_part_raises_nothing():
    callback = _fit(_Gan(whole=False), steps=6)
    assert [f.message for f in callback.findings] == []


def _twice_in_one(sick: bool) -> Fit:
    # The bug: the head's parameters listed twice in the one param group (a list built as body + head + all).
    def params(module: BugModule) -> list[nn.Parameter]:
        extra = list(module.model[-1].parameters()) if sick else []
        return [*module.model.parameters(), *extra]

    return Fit(BugModule(_mlp(), _data(64, 8), optimized=params))


def test_a_parameter_twice_in_one_optimizer_is_reported_and_its_twin_is_silent():
    case = Case("twice_in_one", "", _twice_in_one, "shared_parameters", "model.4", 3)
    sick = run(case, sick=True)
    (hit,) = _hits(sick, "shared_parameters")
    assert (hit.layer, hit.value, hit.step) == ("model.4", 2, 0)
    assert "model.4.weight by optimizer 0, 2 times" in hit.message
    assert [f.message for f in run(case, sick=False).findings] == []


def _user_steps_too(interval: str, user: bool) -> BugModule:
    def scheduler(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
        return {"scheduler": decay, "interval": interval}

    def also_step(module: BugModule, batch_idx: int) -> None:
        if user:  # the bug: stepping a scheduler that Lightning steps too
            module.lr_schedulers().step()

    return BugModule(_mlp(), _data(64, 8), scheduler=scheduler, on_batch=also_step)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_scheduler_stepped_in_training_step_as_well_as_by_lightning_is_reported(interval):
    callback = _fit(_user_steps_too(interval, user=True), steps=12, every_n_steps=4)  # sampled 0, 4, 8
    hits = _hits(callback, "scheduler_overstepped")
    assert [h.step for h in hits] == [4]  # an alert once, from the first step with an earlier one to compare with
    hit = hits[0]
    assert hit.layer == "model.0"
    if interval == "step":
        # Between step 0 and step 4 (scheduler read before each optimizer step): Lightning 4, the user 4 more.
        assert "stepped 8 times since step 0, over 4 optimizer steps" in hit.message
        assert hit.value == 2.0
    else:
        # Within epoch 0 (8 steps an epoch), Lightning never steps an epoch scheduler: only the user's 4 calls.
        assert "stepped 4 times within epoch 0" in hit.message
        assert hit.value == 4.0


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_scheduler_only_lightning_steps_raises_nothing_across_epochs(interval):
    callback = _fit(_user_steps_too(interval, user=False), steps=20, every_n_steps=3)  # crosses 2 epoch ends
    assert [f.message for f in callback.findings] == []


def test_a_scheduler_stepped_by_the_user_under_manual_optimization_is_the_user_s_business():
    # Lightning steps no scheduler under manual optimization: the user steps it as often as they mean to.
    module = _user_steps_too("step", user=True)
    module.automatic_optimization = False
    callback = _fit(module, steps=10, every_n_steps=3)
    assert _hits(callback, "scheduler_overstepped") == []


# ------------------------------------------------------------------------------- Lightning's demo transformer
class _DemoTransformer(LightningTransformer):
    """Lightning's demo transformer on random tokens (its ``prepare_data`` downloads WikiText-2)."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 100, (32, 17), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def test_the_new_rules_are_silent_on_lightning_s_demo_transformer():
    callback = _fit(_DemoTransformer(vocab_size=100), steps=10, rules={"enabled": list(NEW_RULES)})
    assert callback.last_step == 9
    assert [f.message for f in callback.findings] == []


def test_the_small_side_keeps_its_facts_when_it_is_the_only_rule_enabled():
    # input_scale alone still makes the callback gather the weights' shapes it needs (it "uses" param_facts).
    callback = run(SMALL_INPUTS[0], sick=True, rules={"enabled": ["input_scale"]})
    assert [(f.rule, f.layer) for f in callback.findings] == [("input_scale", "model.0")]
    values = values_from_metrics(callback.last_metrics)
    assert values["param_grad_norm"]["model.0.weight"] > 0


def _frozen_stem(sick: bool) -> Fit:
    # A frozen first layer: what the trained layer after it reads are features, not the inputs; not this rule's to
    # judge, whatever their scale (here tiny: the frozen stem's weights were scaled down by 1e-4).
    net = _mlp(64, 32, d_out=2)
    with torch.no_grad():
        net[0].weight.mul_(1e-4)
        net[0].bias.zero_()
    net[0].requires_grad_(False)

    def trainable(module: BugModule) -> list[nn.Parameter]:
        return [p for p in module.parameters() if p.requires_grad]  # the usual filter: the stem is in no group

    return Fit(BugModule(net, _features(64, 64, 1.0), loss="ce", lr=0.01, optimized=trainable))


def test_a_layer_after_a_frozen_first_layer_is_not_checked_for_input_scale():
    case = Case("frozen_stem", "", _frozen_stem, None, None, 2)
    callback = run(case, sick=True, rules={"enabled": ["input_scale"]})
    assert callback.findings == []


def _shared(held: dict[str, tuple[int, ...]]) -> list[Any]:
    facts = {p: ParamFacts(held=True, optimizers=indices) for p, indices in held.items()}
    config = RuleConfig(enabled=["shared_parameters"])
    return run_rules({}, ["g", "d"], [], step=3, config=config, param_facts=facts)


def test_two_optimizers_over_the_whole_model_are_not_called_a_part_and_a_whole():
    # Both optimizers hold everything: no optimizer holds "a part", so the generic message, not the GAN one.
    (both,) = _shared({"g.weight": (0, 1), "d.weight": (0, 1)})
    assert "holds every parameter of the model" not in both.message
    assert "g.weight by optimizers 0 and 1" in both.message
    (gan,) = _shared({"g.weight": (0,), "d.weight": (0, 1)})
    assert (gan.layer, gan.value) == ("d", 1)
    assert "optimizer 0 holds every parameter of the model (built from self.parameters()?) while 1 other" in gan.message
    assert _shared({"g.weight": (0,), "d.weight": (1,)}) == []
