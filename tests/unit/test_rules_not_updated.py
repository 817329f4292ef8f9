"""Rule ``not_updated``: parameters with a finite, non-zero gradient whose weights did not move across the step.

The rounding bound is checked against hand-counted changed entries; the rule on hand-made values and host facts;
the causes on real Lightning fits (the head left out of ``configure_optimizers``, lr 0, ``bf16-true`` with a small
lr), each beside its fixed twin, and the legitimate cases (a frozen parameter, a scheduler warming up from lr 0 or
from a tiny lr, Adam's first step, an fp16 ``GradScaler`` step skipped for overflow) for silence.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import RecordingLogger, TinyModule, make_data, make_trainer, run_rules
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag._optimizer_watch import StepWatch, held_by_none
from lightning_hookdiag.rules import ParamFacts, RuleConfig, moved_mass_bound

P = "layer_health"
LAYERS = ["net.stem", "net.act", "net.head"]
BACKWARD = list(reversed(LAYERS))
BF16 = ParamFacts(held=True, lr=1e-3, dtype="bfloat16", eps=2.0**-7)


# -------------------------------------------------------------------------------------------- the bound
def changed_mass(before: torch.Tensor, after: torch.Tensor) -> tuple[float, float]:
    """Hand count: the share of entries that changed and the share of the squared mass they hold (float64)."""
    changed = before != after
    w = before.double()
    return float(changed.double().mean()), float((w[changed] ** 2).sum() / (w**2).sum())


def ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    return float((after.double() - before.double()).norm() / before.double().norm())


def assert_says(message: str, *facts: str) -> None:
    """The message states every one of ``facts`` (its key facts, not its whole wording)."""
    missing = [fact for fact in facts if fact not in message]
    assert not missing, f"{message!r} lacks {missing}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lr", [1e-6, 1e-4, 1e-3, 1e-2])
def test_the_moved_mass_bound_holds_for_rounded_sgd_steps(dtype, lr):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 64, generator=g) * 0.1).to(dtype)
    grad = torch.randn(256, 64, generator=g).to(dtype)
    after = w.add(grad, alpha=-lr)  # SGD's update, rounded to the weights' dtype
    _, mass = changed_mass(w, after)
    assert mass <= moved_mass_bound(ratio(w, after), torch.finfo(dtype).eps)


def test_the_bound_is_within_4x_when_every_changed_entry_moves_one_ulp():
    # Each changed entry moves by one ulp, which lies in [eps/2 |w|, eps |w|]: the bound is 1 to 4 times the mass.
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(4096, generator=g) * 0.1).to(torch.bfloat16)
    chosen = torch.rand(4096, generator=g) < 0.03
    after = torch.where(chosen, torch.nextafter(w, torch.full_like(w, math.inf)), w)
    count, mass = changed_mass(w, after)
    assert count == pytest.approx(0.03, abs=0.01)
    bound = moved_mass_bound(ratio(w, after), 2.0**-7)
    assert mass <= bound <= 4 * mass


def test_an_update_below_half_an_ulp_leaves_98_percent_unchanged_and_the_bound_says_so():
    # The bf16 case: lr * grad below half an ulp for almost every entry.
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(128, 128, generator=g) * 0.05).to(torch.bfloat16)
    grad = torch.randn(128, 128, generator=g).to(torch.bfloat16) * 0.02
    after = w.add(grad, alpha=-2e-4)
    count, mass = changed_mass(w, after)
    assert count < 0.02  # 98% of the entries never change (those that do are the smallest)
    bound = moved_mass_bound(ratio(w, after), 2.0**-7)
    assert mass <= bound < 0.1


def test_moved_mass_bound_of_known_values():
    assert moved_mass_bound(0.0, 2.0**-7) == 0.0
    assert moved_mass_bound(2.0**-10, 2.0**-7) == 0.0625  # (2 * 2**-10 / 2**-7) ** 2
    assert moved_mass_bound(1.0, 2.0**-7) == 1.0  # capped: a share


# ------------------------------------------------------------------------------------------ the rule alone
def values(grad: float = 0.5, ratio: float = 0.0, names: tuple[str, ...] = ("net.head.weight",)) -> dict:
    return {
        "param_norm": dict.fromkeys(names, 2.0),
        "param_grad_norm": dict.fromkeys(names, grad),
        "param_update_ratio": dict.fromkeys(names, ratio),
    }


def run(vals: dict, facts: dict[str, ParamFacts] | None, config: RuleConfig | None = None) -> list:
    config = config or RuleConfig(enabled=["not_updated"])
    return run_rules(vals, LAYERS, BACKWARD, step=3, config=config, param_facts=facts)


def test_a_parameter_no_optimizer_holds_is_named_with_its_gradient_norm():
    (finding,) = run(values(grad=0.25), {"net.head.weight": ParamFacts(held=False)})
    assert (finding.rule, finding.layer, finding.step) == ("not_updated", "net.head", 3)
    assert (finding.stat, finding.value, finding.threshold, finding.phase) == ("param_grad_norm", 0.25, 0.0, "backward")
    assert_says(
        finding.message,
        "the weights of net.head did not move across step 3",
        "net.head.weight got a gradient (norm 0.25)",
        "no optimizer of the Trainer holds it",
        "add it to configure_optimizers",
    )


def test_a_parameter_no_optimizer_holds_is_reported_without_an_update_ratio_but_not_when_it_moved():
    vals = values()
    del vals["param_update_ratio"]  # stats without param_update_ratio: no snapshot, membership decides
    assert len(run(vals, {"net.head.weight": ParamFacts(held=False)})) == 1
    assert run(values(ratio=1e-3), {"net.head.weight": ParamFacts(held=False)}) == []  # changed by hand


@pytest.mark.parametrize(
    ("lr", "base_lr", "fires"),
    [(0.0, None, True), (0.0, 0.1, False), (0.0, 0.0, True)],
    ids=["no-scheduler", "scheduler-at-0", "scheduler-over-base-0"],
)
def test_lr_zero_fires_unless_a_scheduler_will_raise_it(lr, base_lr, fires):
    facts = {"net.head.weight": ParamFacts(held=True, lr=lr, base_lr=base_lr)}
    found = run(values(), facts)
    assert len(found) == int(fires)
    if fires:
        assert found[0].stat == "param_update_ratio"
        assert (found[0].value, found[0].threshold) == (0.0, 0.1)
        assert "the learning rate of the param group is 0 and no LR scheduler raises it" in found[0].message


def test_rounded_away_fires_below_the_threshold_and_is_exclusive_at_it():
    # ratio 2**-10 in bfloat16: bound (2 * 2**-10 / 2**-7) ** 2 = 1/16.
    facts = {"net.head.weight": BF16}
    (finding,) = run(values(ratio=2.0**-10), facts)
    assert (finding.value, finding.threshold, finding.stat) == (0.0625, 0.1, "param_update_ratio")
    assert_says(
        finding.message,
        "the weights of net.head did not move across step 3",
        "at most 6.25% of the weights' squared mass",
        "param_update_ratio=0.000977",
        "eps=0.00781",
        "moved_mass_threshold=0.1",
        "lr=0.001",
        "rounded away in bfloat16",
        "keep float32 master weights",
    )
    (exact,) = run(values(ratio=0.0), facts)
    assert exact.value == 0.0
    assert "net.head.weight did not change at all although the learning rate is 0.001: the update was" in exact.message
    assert run(values(ratio=2.0**-10), facts, RuleConfig(enabled=["not_updated"], moved_mass_threshold=0.0625)) == []
    assert len(run(values(ratio=2.0**-10), facts, RuleConfig(enabled=["not_updated"], moved_mass_threshold=0.07)))
    assert run(values(ratio=2e-3), facts) == []  # bound 0.26: enough of the weight can have moved


def test_rounding_is_reported_only_where_float32_master_weights_would_have_kept_the_step():
    # values(): gradient 0.5, weight norm 2, so a plain SGD step at lr 1e-3 has ratio 2.5e-4.
    assert len(run(values(ratio=0.0), {"net.head.weight": BF16})) == 1
    float32 = ParamFacts(held=True, lr=1e-3)  # the same step lost in float32 weights (a vanishing gradient's layers)
    assert run(values(ratio=0.0), {"net.head.weight": float32}) == []
    # A residual gradient that asks for no change: lr x gradient is below half a float32 ulp of the weights.
    assert run(values(grad=1e-9, ratio=0.0), {"net.head.weight": BF16}) == []  # ratio 5e-13
    assert len(run(values(grad=2e-4, ratio=0.0), {"net.head.weight": BF16})) == 1  # ratio 1e-7 >= 2**-24
    no_lr = ParamFacts(held=True, dtype="bfloat16", eps=2.0**-7)  # an lr the host could not read
    assert run(values(ratio=0.0), {"net.head.weight": no_lr}) == []
    without_norm = values(ratio=0.0)
    del without_norm["param_norm"]
    assert run(without_norm, {"net.head.weight": BF16}) == []


@pytest.mark.parametrize(("lr", "fires"), [(0.5e-5, False), (2e-5, True)])
def test_rounding_is_silent_while_a_scheduler_holds_the_lr_below_1_percent_of_its_base(lr, fires):
    facts = {"net.head.weight": ParamFacts(held=True, lr=lr, base_lr=1e-3, dtype="bfloat16", eps=2.0**-7)}
    assert len(run(values(ratio=0.0), facts)) == int(fires)


@pytest.mark.parametrize(
    ("grad", "ratio", "facts"),
    [
        (0.0, 0.0, BF16),  # no gradient signal
        (math.nan, 0.0, BF16),  # nonfinite's business
        (math.inf, 0.0, BF16),
        (0.5, math.nan, BF16),  # all-zero weights: no ratio
        (0.5, math.inf, BF16),  # all-zero weights that moved
        (0.5, 0.0, ParamFacts(held=True, applied=False, lr=0.1)),  # the optimizer did not step (GradScaler skip)
        (0.5, 0.0, None),  # no facts
    ],
)
def test_silent_without_a_finite_gradient_a_ratio_an_applied_step_or_facts(grad, ratio, facts):
    assert run(values(grad=grad, ratio=ratio), None if facts is None else {"net.head.weight": facts}) == []


def test_silent_without_facts_and_when_disabled():
    assert run_rules(values(), LAYERS, BACKWARD, step=0) == []  # values of a logger: no host facts
    config = RuleConfig(enabled=["nonfinite"])
    assert run(values(), {"net.head.weight": ParamFacts(held=False)}, config) == []


def test_one_finding_per_owning_module_listing_its_parameters_in_backward_order():
    names = ("net.stem.weight", "net.stem.bias", "net.head.weight", "net.head.bias")
    vals = values(names=names)
    vals["param_grad_norm"]["net.head.bias"] = 0.75
    facts = dict.fromkeys(names, ParamFacts(held=False))
    head, stem = run(vals, facts)
    assert (head.layer, stem.layer) == ("net.head", "net.stem")
    assert head.value == 0.75  # the largest gradient norm of the module's parameters
    assert "net.head.weight, net.head.bias got a gradient (norm 0.5, 0.75)" in head.message
    assert "net.stem.weight, net.stem.bias" in stem.message


def test_a_module_with_several_causes_names_each_and_takes_its_statistic_from_the_first():
    names = ("net.head.weight", "net.head.bias")
    facts = {"net.head.weight": BF16, "net.head.bias": ParamFacts(held=False)}
    (finding,) = run(values(names=names), facts)
    assert (finding.stat, finding.value) == ("param_grad_norm", 0.5)
    assert re.search(r"net\.head\.bias got a gradient .*; net\.head\.weight did not change at all", finding.message)


# ---------------------------------------------------------------------------------------------- host facts
def test_step_watch_finds_parameters_with_a_gradient_outside_every_optimizer():
    body, head, frozen = nn.Linear(2, 2), nn.Linear(2, 1), nn.Linear(2, 2)
    frozen.requires_grad_(False)
    params = [*frozen.parameters(), *body.parameters(), *head.parameters()]
    opt = torch.optim.SGD(body.parameters(), lr=0.1)
    watch = StepWatch()
    assert watch.unheld(params, [opt]) == []  # no gradient yet
    head(body(frozen(torch.ones(1, 2)))).sum().backward()
    assert watch.unheld(params, [opt]) == list(head.parameters())
    opt.add_param_group({"params": [head.weight]})  # membership changed: found again
    assert watch.unheld(params, [opt]) == [head.bias]
    assert watch.unheld(params, [torch.optim.SGD(params, lr=0.1)]) == []
    assert [id(p) for p in held_by_none(params, [opt])] == [id(p) for p in [*frozen.parameters(), head.bias]]


def test_step_watch_reads_the_lr_before_the_step_and_sees_whether_the_step_ran():
    lin, other = nn.Linear(2, 1), nn.Linear(2, 1)
    opt = torch.optim.SGD([{"params": [lin.weight], "lr": 0.0}, {"params": [lin.bias], "lr": 0.2}], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(s))  # lr 0 on step 0
    skipped = torch.optim.SGD(other.parameters(), lr=0.3)
    (lin(torch.ones(1, 2)) + other(torch.ones(1, 2))).sum().backward()
    watch = StepWatch()
    watch.observe(opt)
    watch.observe(skipped)
    opt.step()  # `skipped` never steps, as a GradScaler skips an overflow
    scheduler.step()  # raises the lr after the step, as Lightning does before the step is diagnosed
    names = ["lin.weight", "lin.bias", "other.weight"]
    facts = watch.facts(names, [lin.weight, lin.bias, other.weight])
    assert facts["lin.weight"] == ParamFacts(held=True, applied=True, lr=0.0, base_lr=0.0, shape=(1, 2))
    assert facts["lin.bias"] == ParamFacts(held=True, applied=True, lr=0.0, base_lr=0.2, shape=(1,))
    assert facts["other.weight"] == ParamFacts(held=True, applied=False, lr=0.3, base_lr=None, shape=(1, 2))
    watch.release()
    assert not opt._optimizer_step_post_hooks
    assert not skipped._optimizer_step_post_hooks
    assert watch.facts(names, [lin.weight, lin.bias, other.weight]) == {}


def test_step_watch_facts_of_unheld_shared_and_low_precision_parameters():
    a, b, c = (nn.Parameter(torch.zeros(2, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16, torch.float32))
    first, second = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([a, b], lr=0.5)
    watch = StepWatch()
    watch.observe(first)
    watch.observe(second)
    c.grad = torch.ones(2)
    assert watch.unheld([a, b, c], [first, second]) == [c]
    second.step()
    facts = watch.facts(["a", "b", "c"], [a, b, c])
    assert facts["a"] == ParamFacts(held=True, applied=True, lr=0.5, optimizers=(0, 1), shape=(2,))  # the largest lr
    assert (facts["b"].dtype, facts["b"].eps) == ("bfloat16", 2.0**-7)
    assert facts["c"] == ParamFacts(held=False, applied=False, shape=(2,))
    watch.release()


def test_step_watch_reads_a_host_tensor_lr():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.25))
    watch = StepWatch()
    watch.observe(opt)
    assert watch.facts(["p"], [p])["p"].lr == 0.25
    watch.release()


# ----------------------------------------------------------------------------------------- real Lightning fits
class HeadLeftOut(TinyModule):
    """The classic bug: ``configure_optimizers`` steps the body only."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model[0].parameters(), lr=self.lr)


def fit(module: TinyModule, steps: int = 3, **kwargs) -> tuple[LayerHealthCallback, RecordingLogger]:
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=steps, logger=logger, **kwargs).fit(module)
    return callback, logger


def logged(logger: RecordingLogger, step: int, key: str) -> float:
    return next(m for s, m in logger.ours() if s == step)[f"{P}/{key}"]


def test_the_head_left_out_of_configure_optimizers_is_named_on_the_first_step():
    module = HeadLeftOut()
    callback, logger = fit(module)
    (finding,) = callback.findings
    assert (finding.rule, finding.layer, finding.step, finding.stat) == ("not_updated", "model.2", 0, "param_grad_norm")
    assert "model.2.weight, model.2.bias got a gradient" in finding.message
    assert "no optimizer of the Trainer holds them" in finding.message
    # Reference: the head's gradient on step 0, from the weights and batch the Trainer used.
    _, x, y, weights = module.record[0]
    ref = module.reference_model(weights)
    nn.functional.mse_loss(ref(x), y).backward()
    expected = max(float(p.grad.double().norm()) for p in ref[2].parameters())
    assert finding.value == pytest.approx(expected, rel=1e-6)
    # Measured like the stepped parameters: a gradient, and an update of exactly 0 while the body moves.
    assert logged(logger, 0, "param_update_ratio/model.2.weight") == 0.0
    assert logged(logger, 0, "param_update_ratio/model.0.weight") > 0.0


def test_the_head_included_is_silent():
    callback, _ = fit(TinyModule())
    assert callback.findings == []


def test_lr_zero_without_a_scheduler_names_every_module_and_its_twin_is_silent():
    callback, logger = fit(TinyModule(lr=0.0))
    assert [(f.layer, f.step, f.stat, f.value) for f in callback.findings] == [
        ("model.2", 0, "param_update_ratio", 0.0),
        ("model.0", 0, "param_update_ratio", 0.0),
    ]
    assert "the learning rate of the param group is 0" in callback.findings[0].message
    assert logged(logger, 0, "param_grad_norm/model.0.weight") > 0
    twin, _ = fit(TinyModule(lr=0.1))
    assert twin.findings == []


def bf16_module(lr: float) -> TinyModule:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    return TinyModule(model=net, data=make_data(n=64, d_in=16), lr=lr)


def test_bf16_true_with_a_small_lr_reports_the_update_rounded_away_on_the_first_step():
    module = bf16_module(lr=1e-3)
    callback, logger = fit(module, steps=2, precision="bf16-true")
    hits = [f for f in callback.findings if f.step == 0]
    assert [f.layer for f in hits] == ["model.0"]  # the head's larger gradient still moves it
    (finding,) = hits
    assert "rounded away in bfloat16" in finding.message
    # Reference: the weights before and after step 0, as the Trainer held them (bfloat16).
    before, after = module.record[0][3]["0.weight"], module.record[1][3]["0.weight"]
    assert before.dtype == torch.bfloat16
    count, mass = changed_mass(before, after)
    assert count < 0.05  # more than 95% of the entries of model.0.weight never changed
    r = ratio(before, after)
    assert logged(logger, 0, "param_update_ratio/model.0.weight") == pytest.approx(r, rel=1e-6)
    bounds = [moved_mass_bound(ratio(module.record[0][3][k], module.record[1][3][k]), 2.0**-7) for k in ("0.weight",)]
    assert mass <= bounds[0] < 0.1
    assert finding.value >= bounds[0]  # the largest bound of the module's parameters (the bias may be larger)


@pytest.mark.parametrize(("lr", "precision"), [(1e-3, "32-true"), (3e-2, "bf16-true")])
def test_bf16_twins_float32_weights_or_a_larger_lr_are_silent(lr, precision):
    callback, _ = fit(bf16_module(lr=lr), steps=2, precision=precision)
    assert callback.findings == []


class Warmup(TinyModule):
    """A scheduler that warms the lr up from exactly 0 (``LambdaLR``) or from 1/1000 of it (``LinearLR``)."""

    def __init__(self, kind: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.kind == "lambda":
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 3))
        else:
            scheduler = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_a_scheduler_warming_up_from_lr_0_is_silent():
    callback, logger = fit(Warmup("lambda", lr=0.1), steps=4)
    assert callback.findings == []
    assert callback.last_step == 3  # every step was sampled
    # Guards the test: step 0 had lr 0 (finite, non-zero gradients and no change), step 3 the full lr.
    assert logged(logger, 0, "param_update_ratio/model.0.weight") == 0.0
    assert logged(logger, 0, "param_grad_norm/model.0.weight") > 0.0
    assert logged(logger, 3, "param_update_ratio/model.0.weight") > 0.0


def test_a_bf16_warm_up_from_a_tiny_lr_is_silent_and_the_same_lr_without_a_scheduler_is_not():
    net = bf16_module(lr=0.03)
    callback, logger = fit(Warmup("linear", lr=0.03, model=net.model, data=net.data), steps=4, precision="bf16-true")
    assert callback.findings == []
    # Guards the test: at 3e-5 on step 0 the update of model.0.weight rounds away, as it does without a scheduler.
    assert moved_mass_bound(logged(logger, 0, "param_update_ratio/model.0.weight"), 2.0**-7) < 0.1
    twin, _ = fit(bf16_module(lr=3e-5), steps=1, precision="bf16-true")
    assert [f.layer for f in twin.findings] == ["model.2", "model.0"]
    assert all("rounded away in bfloat16" in f.message for f in twin.findings)


def test_adams_first_step_is_silent():
    callback, logger = fit(TinyModule(lr=1e-3, optimizer="adam"), steps=2)
    assert callback.findings == []
    assert logged(logger, 0, "param_update_ratio/model.0.weight") > 0.0


def test_a_parameter_frozen_with_requires_grad_false_is_not_tracked_or_reported():
    module = TinyModule()
    module.model[0].requires_grad_(False)
    callback, logger = fit(module, steps=2)
    assert callback.findings == []
    assert not any("/model.0." in key for _, metrics in logger.ours() for key in metrics)


class SkippedByTheScaler(TinyModule):
    """A parameter outside the selection gets an Inf gradient on step 1: the GradScaler skips that step."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Parameter(torch.zeros(3))
        self.spare.register_hook(lambda g: g + (math.inf if self.global_step == 1 else 0.0))

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y) + 0.0 * self.spare.sum()


def test_a_step_the_fp16_grad_scaler_skips_is_silent():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, layers=["model.*"], on_anomaly="ignore", output={"summary": False})
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    make_trainer([callback], max_steps=3, logger=logger, plugins=[plugin]).fit(SkippedByTheScaler())
    assert callback.findings == []
    # Guards the test: only step 1 was skipped (the scale halved once), and on it the tracked parameters had finite
    # gradients and an update of exactly 0, which would read as rounded away if the skip went unnoticed.
    assert scaler.get_scale() == 2.0**7
    assert logged(logger, 1, "param_update_ratio/model.0.weight") == 0.0
    assert 0 < logged(logger, 1, "param_grad_norm/model.0.weight") < math.inf
    assert logged(logger, 2, "param_update_ratio/model.0.weight") > 0.0


def test_output_gradients_are_unscaled_by_the_scale_they_were_made_with_not_the_next_one():
    # On the skipped step 1 scaler.update() halves the scale after the optimizer step, before the step is logged.
    # Step 1 computes the same gradients with or without the skip (the Inf only reaches `spare`), so its unscaled
    # output-gradient norms must agree.
    def fit(skip: bool) -> tuple[dict[int, dict[str, float]], float]:
        torch.manual_seed(0)
        module = SkippedByTheScaler()
        if not skip:
            module.spare = nn.Parameter(torch.zeros(3))  # the same parameter, without the Inf hook
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        logger = RecordingLogger()
        callback = LayerHealthCallback(
            every_n_steps=1, layers=["model.*"], on_anomaly="ignore", output={"summary": False}
        )
        plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        make_trainer([callback], max_steps=2, logger=logger, plugins=[plugin]).fit(module)
        return dict(logger.ours()), scaler.get_scale()

    (skipped, low), (kept, high) = fit(True), fit(False)
    assert (low, high) == (2.0**7, 2.0**8)
    key = f"{P}/act_grad_norm/model.2"
    assert skipped[1][key] == kept[1][key]


def test_measuring_parameters_no_optimizer_holds_keeps_one_host_transfer_per_sampled_step(monkeypatch):
    from helpers.cost import CountingCallback, SyncFreeModule, count_host_transfers

    class SyncFreeHeadLeftOut(SyncFreeModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model[0].parameters(), lr=self.lr)

    counter = {"active": False, "calls": 0}
    callback = CountingCallback(counter, every_n_steps=2, on_anomaly="ignore", output={"summary": False}, sentinel=None)
    with count_host_transfers(counter):
        make_trainer([callback], max_steps=5).fit(SyncFreeHeadLeftOut())
    assert callback.per_step == {0: 1, 1: 0, 2: 1, 3: 0, 4: 1}
    assert [(f.rule, f.layer, f.step) for f in callback.findings] == [("not_updated", "model.2", 0)]
