"""FitRun on its own: what one window leaves for the next (discard, release, the kurtosis shift, histograms).

Driven by hand, without a Trainer, so that each reset of ``discard_window``/``open_window``/``release`` is pinned by a
step whose every value is known: the values of a window that follows a discarded one are those of the same window
on a fresh run, and a few are checked against a hand computation as well.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from conftest import TinyModule, by_name, count_hooks, make_trainer
from torch import nn

from lightning_hookdiag import ALL_STATS, LayerHealthCallback
from lightning_hookdiag.components import FACTORIES, Component, FitConfig, Setup, component
from lightning_hookdiag.fit_run import FitRun
from lightning_hookdiag.logged_values import ObservedStep
from lightning_hookdiag.sentinel import MicroBatch, capture_rng


def config(**changes: object) -> FitConfig:
    fields: dict[str, object] = {
        "every_n_steps": 1,
        "layers": None,
        "layer_types": None,
        "exclude": [],
        "stats": (*ALL_STATS, "act_saved_bytes", "act_kurtosis"),
        "prefix": "h",
        "dead_unit_types": (nn.ReLU,),
        "unit_dim": None,
        "histogram_every_n_steps": None,
        "histogram_bins": 8,
        "precision_targets": None,
        "output_layer": None,
        "sentinel_grads": False,
        "rules": frozenset({"eval_mode"}),
    }
    fields.update(changes)
    return FitConfig(**fields)  # type: ignore[arg-type]


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5), nn.ReLU())


def start(model: nn.Module, **changes: object) -> FitRun:
    return FitRun(config(**changes), model, "32-true", lambda params: False)


def window_b(run: FitRun, model: nn.Sequential, opt: torch.optim.Optimizer, x: torch.Tensor) -> ObservedStep:
    """Step 0 in train mode through the first two layers only (the ReLU does not run), then the update."""
    model.train()
    opt.zero_grad(set_to_none=True)
    run.open_window(0, {})
    run.attach(x)
    torch.manual_seed(1)  # the same dropout mask on both runs
    loss = model[1](model[0](x)).sum()
    run.end_forward(loss)
    loss.backward()
    run.end_micro_batch()
    run.before_optimizer_step(opt, [opt], None, True)
    opt.step()
    return run.collect()


def exact(host: dict[str, list[float]]) -> dict[str, list[str]]:
    """Every value by its repr: equal to the last bit, and NaN equal to NaN."""
    return {name: [repr(v) for v in values] for name, values in host.items()}


def test_a_discarded_window_leaves_nothing_in_the_next_one():
    fresh_model = net()
    model = copy.deepcopy(fresh_model)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    run, fresh = start(model), start(fresh_model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    # Window A, then discarded: a larger batch (more saved bytes), dropout in eval mode (an eval_mode fact), an
    # empty output, the ReLU running but cut off from the loss, a GradScaler scale, an update snapshot.
    model.eval()
    run.open_window(0, {})
    run.attach(None)
    out = model[0](torch.randn(8, 4))
    model[2](model[1](out))
    model[0](torch.empty(0, 4))
    loss = out.sum()
    run.end_forward(loss)
    loss.backward()
    run.end_micro_batch()
    run.before_optimizer_step(opt, [opt], torch.tensor(4.0), True)
    run.discard_window()
    assert run.tracker is not None
    assert run.tracker.after_step() is None

    before = model[0].weight.detach().double().clone()
    bias = model[0].bias.detach().double().clone()
    got = window_b(run, model, opt, x)
    want = window_b(fresh, fresh_model, torch.optim.SGD(fresh_model.parameters(), lr=0.1), x)

    assert got.forward_order == ["0", "1"] == want.forward_order
    assert got.backward_order == want.backward_order
    assert got.missing_grads == [] == want.missing_grads
    assert got.eval_mode == {} == want.eval_mode
    assert got.facts == want.facts
    assert not got.facts.empty
    assert exact(got.host) == exact(want.host)  # NaN: a layer that did not run
    # By hand: 2 x 3 outputs per layer, none of the ReLU's; the first layer's mean; SGD's update ratio.
    assert got.host["count"] == [6.0, 6.0, 0.0]
    assert math.isclose(got.host["act_mean"][0], float((x.double() @ before.T + bias).mean()), rel_tol=1e-6)
    ratio = float((model[0].weight.detach().double() - before).norm() / before.norm())
    assert math.isclose(got.host["param_update_ratio"][0], ratio, rel_tol=1e-6)


def test_release_drops_the_kept_micro_batches():
    run = start(net())
    run.state.micro.keep(3, "a micro-batch")
    run.release()
    assert run.state.micro.batches == []
    assert run.state.micro.step is None
    assert not run.state.micro.holds(3)


def test_a_nan_mean_on_the_last_step_shifts_the_kurtosis_sums_by_zero():
    model = nn.Sequential(nn.Linear(4, 3))
    run = start(model, stats=("act_mean", "act_kurtosis"))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    run.open_window(1, {"h/act_mean/0": float("nan")})  # the last sampled step's output was NaN
    run.attach(x)
    with torch.no_grad():
        y = model(x).double()
    run.end_micro_batch()
    got = run.collect(before_update=True).host["act_kurtosis"][0]
    centred = y - y.mean()
    pearson = float((centred**4).mean() / (centred**2).mean() ** 2)  # m4 / m2**2, by hand
    assert math.isclose(got, pearson, rel_tol=1e-9)


def test_a_parameter_window_on_a_histogram_step_has_no_histograms():
    run = start(net(), histogram_every_n_steps=2)
    run.open_window(4, {}, layers=False)
    assert run.recorder.histograms is False
    run.discard_window()
    run.open_window(4, {})
    assert run.recorder.histograms is True
    run.discard_window()
    run.open_window(5, {})
    assert run.recorder.histograms is False


class AbsSum(Component):
    """An opt-in statistic defined outside the package: the sum of |x| of each layer's outputs, pooled by sum."""

    logged = ("act_abs_sum",)

    def __init__(self, aggregator: Any) -> None:
        self.aggregator = aggregator
        aggregator.add_state("abs_sum", aggregator.new_state(aggregator.n_layers, dtype=torch.float64), "sum")

    def on_output(self, layer: int, tensor: torch.Tensor) -> None:
        self.aggregator.pool("abs_sum", tensor.abs().sum(dtype=torch.float64), layer)

    def finalize(self, pooled: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"act_abs_sum": pooled["abs_sum"]}


def test_a_new_statistic_is_one_component_logged_through_a_real_trainer():
    def factory(setup: Setup) -> AbsSum:
        return AbsSum(setup.aggregator)

    component(factory)
    try:
        module = TinyModule()
        seen: dict[str, float] = {}

        def hand(name: str) -> Callable[..., None]:
            def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
                seen[name] = seen.get(name, 0.0) + sum(abs(v) for v in out.detach().double().reshape(-1).tolist())

            return hook

        handles = [layer.register_forward_hook(hand(f"model.{n}")) for n, layer in module.model.named_children()]
        callback = LayerHealthCallback(every_n_steps=10)
        make_trainer([callback], max_steps=1, accumulate_grad_batches=2).fit(module)
        for handle in handles:
            handle.remove()
    finally:
        FACTORIES.remove(factory)
    logged = {k.split("/")[-1]: v for k, v in by_name(callback.last_metrics).items() if "/act_abs_sum/" in k}
    assert logged.keys() == seen.keys() == {"model.0", "model.1", "model.2"}
    for name, value in seen.items():  # two micro-batches pooled
        assert logged[name] == pytest.approx(value, rel=1e-9), name
    assert count_hooks(module) == 0
    assert factory not in FACTORIES


class Watch(Component):
    """Counts, per optimizer step, its attaches and the outputs it is handed."""

    def __init__(self, replays: bool, step: Callable[[], int]) -> None:
        self.replays, self.step, self.seen = replays, step, []

    def attach(self) -> None:
        self.seen.append(("attach", self.step()))
        super().attach()

    def on_output(self, layer: int, tensor: torch.Tensor) -> None:
        self.seen.append(("output", self.step()))


@pytest.mark.parametrize("replays", [True, False])
def test_a_component_is_attached_once_per_micro_batch_and_sees_a_replay_only_if_it_watches_replays(
    monkeypatch, replays
):
    from conftest import force_trips

    force_trips(monkeypatch, {3})  # step 3 is not sampled (every 4): the trip replays it
    trainer = make_trainer([], max_steps=5)
    watch = Watch(replays, lambda: trainer.global_step)

    def factory(setup: Setup) -> Watch:
        return watch

    component(factory)
    try:
        module = TinyModule()
        trainer.callbacks.append(callback := LayerHealthCallback(every_n_steps=4, on_anomaly="ignore", summary=False))
        trainer.fit(module)
    finally:
        FACTORIES.remove(factory)
    assert [t.step for t in callback.trips] == [3]
    attaches = [step for kind, step in watch.seen if kind == "attach"]
    outputs = {step: sum(1 for kind, s in watch.seen if kind == "output" and s == step) for step in (0, 3, 4)}
    assert attaches == ([0, 3, 4] if replays else [0, 4])  # once per micro-batch, not once per caller
    assert outputs[0] == outputs[4] == 3  # the three layers of TinyModule
    assert outputs[3] == (3 if replays else 0)  # no replayed tensor reaches a component that does not watch replays
    assert count_hooks(module) == 0
    assert not watch.attached


class Hooked(Component):
    """Holds one forward hook on ``module``; raises in ``end_micro_batch`` or after its ``remove`` when told to."""

    def __init__(self, module: nn.Module, replays: bool, fail: str = "") -> None:
        self.module, self.replays, self.fail = module, replays, fail

    def attach(self) -> None:
        if not self.attached:
            self.hold().enter_context(self.module.register_forward_hook(lambda *args: None))

    def end_micro_batch(self) -> None:
        if self.fail == "end_micro_batch":
            raise RuntimeError(self.fail)

    def remove(self) -> None:
        super().remove()
        if self.fail == "remove":
            raise RuntimeError(self.fail)


@pytest.mark.parametrize("end", [True, False], ids=["end_micro_batch", "detach"])
@pytest.mark.parametrize("fail", ["end_micro_batch", "remove"])
@pytest.mark.parametrize("replays", [True, False])
def test_a_component_that_raises_leaves_no_hook_of_any_other_behind(end, fail, replays):
    model = net()
    failing = Hooked(model[0], replays, fail)
    others = [Hooked(model[2], False), Hooked(model[2], True)]
    factories = [lambda setup, c=c: c for c in (failing, *others)]
    for factory in factories:
        component(factory)
    try:
        run = start(model)
    finally:
        for factory in factories:
            FACTORIES.remove(factory)
    run.open_window(0, {})
    run.attach(None)
    assert all(c.attached for c in (failing, *others))
    raises = fail == "remove" or end
    with pytest.raises(RuntimeError, match=fail) if raises else contextlib.nullcontext():
        run.end_micro_batch() if end else run.detach()
    assert count_hooks(model) == 0
    assert not any(c.attached for c in (failing, *others))


def test_release_drops_the_window_and_the_micro_batches_also_when_a_component_raises():
    model = net()
    failing = Hooked(model[0], False, "remove")
    factory = component(lambda setup: failing)
    try:
        run = start(model)
    finally:
        FACTORIES.remove(factory)
    run.open_window(0, {})
    run.state.micro.keep(0, MicroBatch(torch.ones(2, 4), 0, capture_rng(torch.device("cpu"))))
    run.attach(None)
    with pytest.raises(RuntimeError, match="remove"):
        run.release()
    assert count_hooks(model) == 0
    assert run.state.window is None
    assert run.state.micro.batches == []
