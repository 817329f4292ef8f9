"""The rules added with the bug benchmark: update_ratio, stale_gradients, input_scale (see docs/rules.md's table).

Detection and silence by hand on plain values, then stale_gradients end to end in real fits (its value comes from
the callback, not from a logged statistic). Silence on the healthy zoo is test_rules_zoo.py's (every rule enabled),
on the bugs' fixed twins tests/bugs/test_bugs.py's.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from helpers import by_name, make_data, make_trainer, run_rules
from torch import nn
from torch.utils.data import DataLoader

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.rules import Baseline, RuleConfig

ORDER = ["fc1", "act", "fc2"]


def _ratios(r1: float, r2: float, grad: float = 1.0) -> dict[str, dict[str, float]]:
    return {
        "param_update_ratio": {"fc1.weight": r1, "fc1.bias": r1, "fc2.weight": r2},
        "param_norm": {"fc1.weight": 3.0, "fc1.bias": 4.0, "fc2.weight": 2.0},
        "param_grad_norm": {"fc1.weight": grad, "fc1.bias": grad, "fc2.weight": grad},
    }


def _run(values, baseline=None, **config):
    cfg = RuleConfig(enabled=["update_ratio", "stale_gradients", "input_scale"], **config)
    return run_rules(values, ORDER, ORDER[::-1], step=5, config=cfg, baseline=baseline)


# ----------------------------------------------------------------------------------------------- update_ratio
def test_update_ratio_fires_when_every_layer_is_below_on_two_sampled_steps():
    values = _ratios(2e-6, 4e-6)
    values["param_update_ratio"]["fc1.bias"] = 1e-6
    (f,) = _run(values, Baseline(0, _ratios(3e-6, 5e-6)))
    assert (f.rule, f.layer, f.step, f.stat, f.threshold) == ("update_ratio", "fc1", 5, "param_update_ratio", 1e-5)
    # fc1 pooled by hand: sqrt((2e-6 * 3)**2 + (1e-6 * 4)**2) / 5 = 1.44e-6; fc2 is the faster layer.
    assert math.sqrt((2e-6 * 3) ** 2 + (1e-6 * 4) ** 2) / 5 < 4e-6
    assert f.value == pytest.approx(4e-6, rel=1e-12)
    assert "most, 4e-06, in fc2" in f.message
    assert "at step 5 and at step 0" in f.message


def test_update_ratio_pools_a_layers_parameters_by_their_norms():
    values = _ratios(2e-6, 1e-7)
    values["param_update_ratio"]["fc1.bias"] = 1e-6
    (f,) = _run(values, Baseline(0, _ratios(1e-7, 1e-7)))
    assert f.value == pytest.approx(math.sqrt((2e-6 * 3) ** 2 + (1e-6 * 4) ** 2) / 5, rel=1e-12)


@pytest.mark.parametrize(
    ("now", "before"),
    [
        (_ratios(2e-6, 2e-5), _ratios(2e-6, 2e-6)),  # one layer still moves
        (_ratios(2e-6, 2e-6), _ratios(2e-6, 3e-5)),  # only one step is slow (a scheduler's low point)
        (_ratios(0.0, 0.0), _ratios(0.0, 0.0)),  # no update at all: not a small one (lr 0, no param group)
        (_ratios(2e-6, 2e-6, grad=0.0), _ratios(2e-6, 2e-6, grad=0.0)),  # weight decay alone, no gradient
        # Converged: the gradient is what is small (an effective lr of 5 * 2e-6 / (sqrt(2) * 1e-5) = 0.7).
        (_ratios(2e-6, 2e-6, grad=1e-5), _ratios(2e-6, 2e-6, grad=1e-5)),
    ],
)
def test_update_ratio_is_silent_unless_the_whole_network_is_slow_on_both_steps(now, before):
    assert _run(now, Baseline(0, before)) == []


def test_update_ratio_needs_the_gradient_small_against_the_update_by_effective_lr_low():
    # fc1: ||dw|| = 5 * 2e-6 = 1e-5 against ||g|| = sqrt(2) * grad; fc2: 2 * 2e-6 = 4e-6 against grad.
    grad = 1e-5 / (math.sqrt(2) * 4e-4)  # fc1's effective lr is 4e-4, fc2's 4e-6 / grad = 2.26e-4
    values = _ratios(2e-6, 2e-6, grad=grad)
    assert len(_run(values, Baseline(0, values))) == 1
    assert _run(values, Baseline(0, values), effective_lr_low=3.9e-4) == []  # fc1 is no longer slow


def test_update_ratio_is_silent_without_gradient_norms():
    values = _ratios(2e-6, 2e-6)
    del values["param_grad_norm"]
    assert _run(values, Baseline(0, values)) == []


def test_update_ratio_needs_a_previous_sampled_step_and_skips_zero_weights():
    assert _run(_ratios(2e-6, 2e-6)) == []
    zero = _ratios(2e-6, 2e-6)
    zero["param_norm"] = dict.fromkeys(zero["param_norm"], 0.0)
    assert _run(zero, Baseline(0, zero)) == []


# -------------------------------------------------------------------------------------------- stale_gradients
def test_stale_gradients_names_the_first_layer_in_forward_order_holding_one():
    values = {"param_stale_grad_norm": {"fc2.weight": 0.5, "fc1.bias": 0.25}}
    (f,) = _run(values)
    assert (f.rule, f.layer, f.value, f.stat, f.phase) == (
        "stale_gradients",
        "fc1",
        2.0,
        "param_stale_grad_norm",
        "backward",
    )
    assert "fc1.bias in fc1, the first of 2 layers" in f.message
    assert "norm 0.25" in f.message


def test_stale_gradients_counts_nan_and_ignores_zeros():
    assert _run({"param_stale_grad_norm": {"fc1.weight": 0.0}}) == []
    assert _run({"param_stale_grad_norm": {}}) == []
    (f,) = _run({"param_stale_grad_norm": {"fc2.weight": math.nan}})
    assert f.layer == "fc2"


# ------------------------------------------------------------------------------------------------ input_scale
def test_input_scale_reads_the_rms_of_the_first_layer_in_forward_order():
    values = {"act_mean": {"fc1": 30.0, "act": 0.1, "fc2": 500.0}, "act_std": {"fc1": 40.0, "act": 1.0, "fc2": 1.0}}
    (f,) = _run(values)
    assert (f.rule, f.layer, f.stat, f.threshold) == ("input_scale", "fc1", "act_std", 20.0)
    assert f.value == pytest.approx(50.0)  # sqrt(30**2 + 40**2)
    assert _run(values, input_scale_limit=51.0) == []


def test_input_scale_only_looks_at_the_first_sampled_step_of_a_fit():
    # Later, a large first-layer output comes as often from weights that blew up as from the inputs.
    values = {"act_mean": {"fc1": 30.0}, "act_std": {"fc1": 40.0}}
    assert _run(values, Baseline(0, values)) == []


def test_input_scale_is_silent_on_a_large_later_layer_and_falls_back_to_absmax():
    later = {"act_mean": {"fc1": 0.0, "fc2": 500.0}, "act_std": {"fc1": 1.0, "fc2": 1.0}}
    assert _run(later) == []
    (f,) = _run({"act_absmax": {"fc1": 300.0, "fc2": 1.0}})
    assert (f.layer, f.value, f.stat) == ("fc1", 300.0, "act_absmax")


# --------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("update_ratio_low", 0.0, "a number in (0, 1)"),
        ("update_ratio_low", 1.0, "a number in (0, 1)"),
        ("update_ratio_low", True, "a number in (0, 1)"),
        ("effective_lr_low", 0.0, "a finite number > 0"),
        ("effective_lr_low", math.nan, "a finite number > 0"),
        ("input_scale_limit", 1.0, "a finite number > 1"),
        ("input_scale_limit", math.inf, "a finite number > 1"),
        ("input_scale_limit", "20", "a finite number > 1"),
    ],
)
def test_config_rejects_bad_values_naming_them(field, value, valid):
    with pytest.raises(ValueError, match=f"^{field}: ") as info:
        RuleConfig(**{field: value})
    assert valid in str(info.value)
    assert str(info.value).endswith(f"got {value!r}")


# ------------------------------------------------------------------------------------- stale gradients in fits
class Manual(pl.LightningModule):
    """Manual optimization with one of the ways to handle ``.grad``; records the gradient before each backward."""

    def __init__(self, zero: str, optimizers: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.zero = zero
        self.n_optimizers = optimizers
        self.held: dict[int, float | None] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for opt in opts:
            if self.zero == "before":
                opt.zero_grad(set_to_none=False)
            loss = nn.functional.mse_loss(self.model(x), y)
            grad = self.model[0].weight.grad
            self.held.setdefault(self.global_step, None if grad is None else float(grad.norm()))
            self.manual_backward(loss)
            opt.step()
            if self.zero == "after":
                opt.zero_grad()

    def configure_optimizers(self):
        if self.n_optimizers == 1:
            return torch.optim.SGD(self.parameters(), lr=0.01)
        return [
            torch.optim.SGD(self.model[0].parameters(), lr=0.01),
            torch.optim.SGD(self.model[2].parameters(), lr=0.01),
        ]

    def train_dataloader(self):
        return DataLoader(make_data(), batch_size=8)


def _fit(module: pl.LightningModule, every: int = 1, steps: int = 3, **trainer) -> LayerHealthCallback:
    callback = LayerHealthCallback(every_n_steps=every, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=steps, **trainer).fit(module)
    return callback


@pytest.mark.parametrize("every", [1, 2])
def test_gradients_never_zeroed_are_found_on_the_first_sampled_step_after_one(every):
    module = Manual(zero="never")
    callback = _fit(module, every=every, steps=every + 1)
    (f,) = [f for f in callback.findings if f.rule == "stale_gradients"]
    assert (f.layer, f.step, f.value) == ("model.0", every, 4.0)  # every tracked parameter holds one
    assert f"norm {module.held[every]:.3g})" in f.message  # model.0.weight's .grad as training_step saw it


@pytest.mark.parametrize("zero", ["before", "after"])
def test_gradients_zeroed_before_the_backward_or_after_the_step_are_not_stale(zero):
    assert _fit(Manual(zero=zero)).findings == []


def test_two_optimizers_are_not_checked():
    # Each optimizer's gradients wait through the other's step (zero_grad before each backward, as in a GAN).
    module = Manual(zero="never", optimizers=2)
    assert _fit(module).findings == []
    assert module.held[2] is not None


def test_automatic_optimization_with_accumulation_is_not_stale():
    from helpers import TinyModule

    assert _fit(TinyModule(), steps=3, accumulate_grad_batches=2).findings == []


def test_the_check_leaves_training_bit_identical():
    weights = []
    for callback in (True, False):
        torch.manual_seed(0)
        module = Manual(zero="never")
        cbs = [LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})] if callback else []
        make_trainer(cbs, max_steps=4).fit(module)
        weights.append([p.detach().clone() for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


# --------------------------------------------------------------------------------------- update_ratio in fits
class Finetune(pl.LightningModule):
    """Linear (std 0.02), LayerNorm, ReLU, Linear (std 0.02) with AdamW, an optional linear warm-up from lr 0."""

    def __init__(self, lr: float, warmup: int = 0) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))
        for linear in (self.model[0], self.model[3]):  # initialised as Hugging Face's BERT and GPT-2 are
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        self.lr = lr
        self.warmup = warmup

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.warmup:
            return opt
        ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": ramp, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(make_data(n=64), batch_size=8)


def _pooled(metrics: dict[str, float], layer: str) -> float:
    # sqrt(sum (ratio * norm)**2 / sum norm**2) over the layer's parameters, from the logged values.
    metrics = by_name(metrics)
    names = [k.rsplit("/", 1)[1] for k in metrics if k.startswith(f"layer_health/param_norm/{layer}.")]
    update = sum(
        (metrics[f"layer_health/param_update_ratio/{n}"] * metrics[f"layer_health/param_norm/{n}"]) ** 2 for n in names
    )
    weight = sum(metrics[f"layer_health/param_norm/{n}"] ** 2 for n in names)
    return math.sqrt(update / weight)


def test_update_ratio_is_silent_on_fine_tuning_where_only_the_norm_layer_is_slow():
    callback = _fit(Finetune(lr=5e-6), steps=4)
    metrics = callback.last_metrics
    assert _pooled(metrics, "model.1") < 1e-5  # the LayerNorm alone would fire
    assert _pooled(metrics, "model.0") > 20 * _pooled(metrics, "model.1")
    assert callback.findings == []


def test_update_ratio_is_silent_through_a_warm_up_from_lr_0():
    callback = _fit(Finetune(lr=1e-3, warmup=100), steps=4)
    assert by_name(callback.last_metrics)["layer_health/param_update_ratio/model.0.weight"] > 1e-5
    assert callback.findings == []


def test_update_ratio_fires_on_a_learning_rate_typo_in_this_fit():
    callback = _fit(Finetune(lr=1e-8), steps=2)
    (f,) = callback.findings
    assert (f.rule, f.layer, f.step) == ("update_ratio", "model.0", 1)
    fastest = max(_pooled(callback.last_metrics, layer) for layer in ("model.0", "model.1", "model.3"))
    assert f.value == pytest.approx(fastest, rel=1e-9)
