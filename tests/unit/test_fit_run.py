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
from helpers import TinyModule, by_name, count_hooks, make_trainer
from torch import nn

from lightning_hookdiag import ALL_STATS, LayerHealthCallback
from lightning_hookdiag._fit_run import FitRun, StepCheck
from lightning_hookdiag._logged_values import ObservedStep
from lightning_hookdiag._rerun import MicroBatch, capture_rng
from lightning_hookdiag._sentinel import LossSentinel, SpikeDetector
from lightning_hookdiag.builtins import split_extensions
from lightning_hookdiag.components import Component, FitConfig, Setup, component


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


def start(model: nn.Module, extensions: list[Any] | None = None, **changes: object) -> FitRun:
    return FitRun(config(**changes), model, "32-true", lambda params: False, None, split_extensions(extensions or []))


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
    assert got.facts["missing_grads"] == [] == want.facts["missing_grads"]
    assert got.facts["eval_mode"] == {} == want.facts["eval_mode"]
    assert got.unobserved == want.unobserved
    assert not got.unobserved.empty
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
    @component
    def factory(setup: Setup) -> AbsSum:
        return AbsSum(setup.aggregator)

    module = TinyModule()
    seen: dict[str, float] = {}

    def hand(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen[name] = seen.get(name, 0.0) + sum(abs(v) for v in out.detach().double().reshape(-1).tolist())

        return hook

    handles = [layer.register_forward_hook(hand(f"model.{n}")) for n, layer in module.model.named_children()]
    callback = LayerHealthCallback(every_n_steps=10, extensions=[factory])
    other = LayerHealthCallback(every_n_steps=10, prefix="plain")
    make_trainer([callback, other], max_steps=1, accumulate_grad_batches=2).fit(module)
    for handle in handles:
        handle.remove()
    logged = {k.split("/")[-1]: v for k, v in by_name(callback.last_metrics).items() if "/act_abs_sum/" in k}
    assert logged.keys() == seen.keys() == {"model.0", "model.1", "model.2"}
    for name, value in seen.items():  # two micro-batches pooled
        assert logged[name] == pytest.approx(value, rel=1e-9), name
    assert count_hooks(module) == 0
    assert not [k for k in other.last_metrics if "act_abs_sum" in k]  # the other callback's fit did not build it


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
def test_a_component_is_attached_once_per_micro_batch_and_sees_a_replay_only_if_it_watches_replays(replays):
    from helpers import force_trips

    trainer = make_trainer([], max_steps=5)
    watch = Watch(replays, lambda: trainer.global_step)

    @component
    def factory(setup: Setup) -> Watch:
        return watch

    module = TinyModule()
    # Step 3 is not sampled (every 4): the trip replays it.
    callback = LayerHealthCallback(
        every_n_steps=4,
        on_anomaly="ignore",
        sentinel=force_trips({3}),
        output={"summary": False},
        extensions=[factory],
    )
    trainer.callbacks.append(callback)
    trainer.fit(module)
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
    factories = [component(lambda setup, c=c: c) for c in (failing, *others)]
    run = start(model, factories)
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
    run = start(model, [component(lambda setup: failing)])
    run.open_window(0, {})
    run.state.micro.keep(0, MicroBatch(torch.ones(2, 4), 0, capture_rng(torch.device("cpu"))))
    run.attach(None)
    with pytest.raises(RuntimeError, match="remove"):
        run.release()
    assert count_hooks(model) == 0
    assert run.state.window is None
    assert run.state.micro.batches == []


# ----------------------------------------------------------------------------------- a trip through the engine
class PlainLoop:
    """A plain PyTorch loop (one optimizer, no scaler, loss = model(batch).sum()) as the engine's TrainingLoop."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, blocker: str | None = None) -> None:
        self.model, self.opt, self.blocker = model, opt, blocker
        self.replays = 0

    def loss_scale(self) -> torch.Tensor | None:
        return None

    def replay_blocker(self) -> str | None:
        return self.blocker

    def micro_batch_loss(self, micro: MicroBatch) -> torch.Tensor | None:
        self.replays += 1
        return self.model(micro.batch).sum()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opt]

    def holds_parameters(self) -> bool:
        return True

    def schedule(self, optimizer: torch.optim.Optimizer) -> tuple[str | None, int | None, int | None, int | None]:
        return None, None, None, None


def plain_step(run: FitRun, loop: PlainLoop, step: int, x: torch.Tensor) -> StepCheck | None:
    """One optimizer step of ``loop`` driven through the engine's transitions, as the callback drives them."""
    run.begin_micro_batch(step, x, step, loop.optimizers(), {})
    loss = loop.model(x).sum()
    run.before_backward(loss, 1)
    loss.backward()
    run.after_backward()
    checked = run.check_step(step, loop.opt, loop, lambda trip: False, {})
    if checked is None:  # a tripped step is skipped, as a GradScaler skips one with inf/NaN gradients
        loop.opt.step()
    loop.opt.zero_grad(set_to_none=True)
    run.end_micro_batch()
    return checked


def sentinel_run(model: nn.Module) -> FitRun:
    sentinel = LossSentinel("loss", SpikeDetector(warmup=1))
    return FitRun(
        config(every_n_steps=10, stats=("act_mean", "param_norm")), model, "32-true", lambda p: False, sentinel
    )


def test_a_trip_is_replayed_by_the_engine_into_a_window_of_its_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    loop = PlainLoop(model, torch.optim.SGD(model.parameters(), lr=0.1))
    run = sentinel_run(model)
    x, bad = torch.ones(2, 4), torch.full((2, 4), float("nan"))
    assert plain_step(run, loop, 0, x) is None  # sampled, not tripped
    assert run.close_past(1, []) is not None  # step 0's window
    before = model[0].weight.detach().clone()
    checked = plain_step(run, loop, 1, bad)
    assert checked is not None
    assert checked.observed
    assert (checked.trip.step, checked.trip.kind, checked.trip.replayed, checked.trip.reason) == (
        1,
        "nonfinite_loss",
        True,
        "",
    )
    assert checked.trip.bad_batch == (("batch", 8, 8),)  # the kept micro-batch was read once
    assert loop.replays == 1
    observed = run.close_past(2, [])
    assert observed is not None
    assert observed.step == 1
    assert observed.trip == checked.trip
    assert observed.layers
    # The replay's forward, counted once: 2 rows of 3 NaN outputs; the weights before the update.
    assert observed.host["count"] == [6.0]
    assert math.isnan(observed.host["act_mean"][0])
    assert observed.host["param_norm"][0] == pytest.approx(float(before.double().norm()), rel=1e-6)
    assert count_hooks(model) == 0


def test_a_replay_that_raises_leaves_a_window_of_the_parameters_and_samples_the_next_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    loop = PlainLoop(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loop.micro_batch_loss = lambda micro: (_ for _ in ()).throw(ValueError("no data"))  # type: ignore[method-assign]
    run = sentinel_run(model)
    plain_step(run, loop, 0, torch.ones(2, 4))
    run.close_past(1, [])
    checked = plain_step(run, loop, 1, torch.full((2, 4), float("nan")))
    assert checked is not None
    assert checked.observed
    assert not checked.trip.replayed
    assert checked.trip.reason == "the replay raised ValueError: no data"
    observed = run.close_past(2, ["0"])
    assert observed is not None
    assert observed.step == 1
    assert not observed.layers
    assert observed.forward_order == ["0"]
    # Step 2 is not on the schedule (every 10) but is sampled: the step after a trip that was not replayed.
    assert plain_step(run, loop, 2, torch.ones(2, 4)) is None
    sampled = run.close_past(3, [])
    assert sampled is not None
    assert sampled.step == 2
    assert sampled.layers
    assert sampled.host["count"] == [6.0]


def test_a_blocked_trip_of_a_persisting_failure_is_only_recorded():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    loop = PlainLoop(model, torch.optim.SGD(model.parameters(), lr=0.0), blocker="of manual optimization")
    run = sentinel_run(model)
    plain_step(run, loop, 0, torch.ones(2, 4))
    run.close_past(1, [])
    bad = torch.full((2, 4), float("nan"))
    first = plain_step(run, loop, 1, bad)
    assert first is not None
    assert first.observed
    assert first.trip.reason == "of manual optimization"
    assert run.close_past(2, []) is not None  # step 1's parameters
    second = plain_step(run, loop, 2, bad)  # step 2 is sampled (the step after), its hooks saw it
    assert second is not None
    assert second.observed
    assert second.trip.replayed
    assert run.close_past(3, []) is not None
    third = plain_step(run, loop, 3, bad)
    assert third is not None
    assert not third.observed
    assert third.trip.reason.startswith("the previous step tripped too")
    assert run.close_past(4, []) is None
    assert loop.replays == 0


def test_default_stats_build_no_opt_in_component_and_register_no_opt_in_state():
    run = start(TinyModule(), stats=ALL_STATS)
    components, states = {type(c).__name__ for c in run.components}, set(run.aggregator.reduce_of)
    assert not {"PrecisionHeadroom", "Outliers", "SavedMemoryTracker"} & components
    assert "PrecursorProbes" in components  # on by default
    assert not {"act_precision", "grad_precision", "act_power", "act_saved"} & states
