"""NaN provenance: a NaN made by functional code between two selected layers is named at the module that made it."""

from __future__ import annotations

import pytest
import torch
from helpers import RecordingLogger, TinyModule, count_hooks, force_trips, make_data, make_trainer, run_rules
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthError, Trip
from lightning_hookdiag.rules import LOSS, ROOT

BAD_STEP = 13


class Clock:
    step = -1


def clocked(module: TinyModule) -> Clock:
    clock = Clock()
    module.on_step = lambda m, batch_idx: setattr(clock, "step", m.global_step)
    return clock


def drifted(x: torch.Tensor, clock: Clock) -> torch.Tensor:
    """``x`` mapped to positive values, except on BAD_STEP where every value drifts below zero."""
    return nn.functional.softplus(x) + (1.0 if clock.step != BAD_STEP else -100.0)


class Wrapper(nn.Module):
    """A container without parameters of its own: its forward is ``log(self.lin(x))`` (the issue's case)."""

    def __init__(self, lin: nn.Linear, clock: Clock) -> None:
        super().__init__()
        self.lin, self.clock = lin, clock

    def forward(self, x):
        return torch.log(drifted(self.lin(x), self.clock))


class Net(nn.Module):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.scale = Wrapper(nn.Linear(4, 8), clock)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.scale(x))


class OnceAStep(TinyModule):
    """Runs ``training_step`` once per step: called again for a step (a replay's re-run), it returns ``None``, which
    Lightning's contract reads as "nothing to back-propagate", so a re-run through the trace has no forward to trace."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stepped: set[int] = set()

    def training_step(self, batch, batch_idx):
        if self.global_step in self.stepped:
            return None
        self.stepped.add(self.global_step)
        return super().training_step(batch, batch_idx)


def wrapped_module(kind: type[TinyModule] = TinyModule) -> TinyModule:
    torch.manual_seed(0)  # the same initial weights for every instance
    module = kind(data=make_data(n=256), lr=0.01)
    module.model = Net(clocked(module))
    module.record_enabled = False
    return module


def assert_says(message: str, *facts: str) -> None:
    """The message states every one of ``facts`` (its key facts, not its whole wording)."""
    missing = [fact for fact in facts if fact not in message]
    assert not missing, f"{message!r} lacks {missing}"


def test_a_nan_made_inside_a_wrappers_forward_is_named_at_the_wrapper():
    module = wrapped_module()
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=BAD_STEP + 1).fit(module)

    assert callback.layer_names == ["model.scale.lin", "model.out"]  # the wrapper owns no parameter: not selected
    trip = callback.trips[0]
    assert (trip.step, trip.kind, trip.replayed) == (BAD_STEP, "nonfinite_loss", True)
    assert (trip.nan_entry, trip.nan_origin) == ("model.out", "model.scale")
    first = callback.findings[0]
    assert (first.rule, first.layer, first.step, first.stat) == ("nonfinite", "model.scale", BAD_STEP, "act_nonfinite")
    assert first.value == 8  # model.out's 8 NaN outputs (a batch of 8, one output each)
    assert "made inside the forward of model.scale" in first.message
    assert "after the output of model.scale.lin and before the input of model.out" in first.message
    assert count_hooks(module) == 0


def test_a_nan_made_on_a_sampled_step_is_traced_by_a_re_run_that_adds_nothing_to_its_statistics():
    # BAD_STEP is sampled (every step is): the hooks saw it as it happened, and a re-run through the trace alone
    # names the wrapper. Without the re-run the same step logs the same values: the re-run was not counted.
    logged = {}
    for traced in (True, False):
        # Untraced: the module's training_step declines to run a step twice, so the re-run has no forward.
        module = wrapped_module(TinyModule if traced else OnceAStep)
        logger = RecordingLogger()
        callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
        make_trainer([callback], max_steps=BAD_STEP + 1, logger=logger).fit(module)
        (trip,) = callback.trips
        assert (trip.step, trip.kind, trip.replayed) == (BAD_STEP, "nonfinite_loss", True)
        assert (trip.nan_entry, trip.nan_origin) == (("model.out", "model.scale") if traced else (None, None))
        assert callback.findings[0].layer == ("model.scale" if traced else "model.out")
        logged[traced] = dict(logger.calls)[BAD_STEP]
        assert count_hooks(module) == 0
    assert logged[True].keys() == logged[False].keys()
    assert logged[True]["layer_health/act_nonfinite/model.out"] == 8.0  # one batch of 8, not two
    for key, value in logged[False].items():
        assert logged[True][key] == value or (value != value and logged[True][key] != logged[True][key]), key


def test_raise_names_the_wrapper_before_the_step_and_the_replay_changed_nothing():
    plain = wrapped_module()
    make_trainer([], max_steps=BAD_STEP).fit(plain)
    module = wrapped_module()
    trainer = make_trainer([LayerHealthCallback(every_n_steps=10, on_anomaly="raise")], max_steps=BAD_STEP + 1)
    with pytest.raises(LayerHealthError, match=rf"at step {BAD_STEP} in model\.scale \(rule nonfinite\)"):
        trainer.fit(module)
    assert trainer.global_step == BAD_STEP
    for (name, a), b in zip(plain.state_dict().items(), module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the traced replay left the weights as training made them
    assert count_hooks(module) == 0


class RootLog(TinyModule):
    """The NaN is made in the LightningModule's own forward, between its two layers."""

    def __init__(self) -> None:
        super().__init__(data=make_data(n=256), lr=0.01)
        self.model = nn.Identity()
        self.first, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
        self.clock = clocked(self)
        self.record_enabled = False

    def forward(self, x):
        return self.out(torch.log(drifted(self.first(x), self.clock)))


def test_a_nan_made_in_the_lightning_modules_own_forward_is_named_root():
    module = RootLog()
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=BAD_STEP + 1).fit(module)
    assert (callback.trips[0].nan_entry, callback.trips[0].nan_origin) == ("out", ROOT)
    first = callback.findings[0]
    assert (first.rule, first.layer, first.stat) == ("nonfinite", ROOT, "act_nonfinite")
    assert f"inside the LightningModule's own forward ({ROOT})" in first.message
    assert "after the output of first and before the input of out" in first.message
    assert count_hooks(module) == 0


class StepLog(RootLog):
    """The NaN is made in training_step, between two modules called there (no forward contains it)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.on_step(self, batch_idx)
        return self.loss(self.out(torch.log(drifted(self.first(x), self.clock))), y)


def test_a_nan_made_in_training_step_between_two_modules_is_named_outside_every_forward():
    module = StepLog()
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=BAD_STEP + 1).fit(module)
    assert (callback.trips[0].nan_entry, callback.trips[0].nan_origin) == ("out", None)
    first = callback.findings[0]
    assert (first.rule, first.layer, first.stat) == ("nonfinite", ROOT, "act_nonfinite")
    assert "made outside every module's forward (in training_step" in first.message
    assert "after the output of first and before the input of out" in first.message


class LossLog(TinyModule):
    """The NaN is made in the loss function: every layer's output stays finite."""

    def __init__(self) -> None:
        super().__init__(data=make_data(n=256), lr=0.01)
        self.clock = clocked(self)
        self.record_enabled = False

    def loss(self, out, y):
        return torch.log(drifted(out - y, self.clock)).mean()


def test_a_nan_made_in_the_loss_function_keeps_the_outside_the_observed_layers_message():
    module = LossLog()
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=BAD_STEP + 1).fit(module)
    trip = callback.trips[0]
    assert (trip.step, trip.replayed, trip.nan_entry, trip.nan_origin) == (BAD_STEP, True, None, None)
    first = callback.findings[0]
    assert (first.rule, first.layer, first.stat) == ("nonfinite", LOSS, "loss")
    assert "so the NaN/Inf arose outside them" in first.message


def test_a_nan_made_by_a_selected_layer_itself_keeps_todays_message():
    # The sentinel tests' NaN module is selected (a leaf): its input was finite, so it is the origin as before.
    class NaNAt(nn.Module):
        def __init__(self, clock):
            super().__init__()
            self.clock = clock

        def forward(self, x):
            return x * float("nan") if self.clock.step == BAD_STEP else x

    module = TinyModule(data=make_data(n=256), lr=0.01)
    module.model = nn.Sequential(nn.Linear(4, 8), NaNAt(clocked(module)), nn.Linear(8, 1))
    module.record_enabled = False
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=BAD_STEP + 1).fit(module)
    assert (callback.trips[0].nan_entry, callback.trips[0].nan_origin) == (None, None)
    first = callback.findings[0]
    assert (first.layer, first.stat) == ("model.1", "act_nonfinite")
    assert "the first non-finite layer in forward order" in first.message


# ------------------------------------------------------------------------------------------------------ cost
def global_hooks_per_call(module: TinyModule) -> list[tuple[int, int]]:
    """``(step, global forward hooks installed)`` at each call of ``module``'s ``training_step``, replays included.

    The trace is a global forward hook (``torch.nn.modules.module.register_module_forward_hook``): a call made through
    it runs under one more global hook than the training call of the same step.
    """
    calls: list[tuple[int, int]] = []
    before = module.on_step

    def on_step(m: TinyModule, batch_idx: int) -> None:
        if before is not None:
            before(m, batch_idx)
        calls.append((m.global_step, len(torch.nn.modules.module._global_forward_hooks)))

    module.on_step = on_step
    return calls


def hooks_per_call(module: TinyModule, steps: int, every: int, sentinel: object) -> list[tuple[int, int]]:
    calls = global_hooks_per_call(module)
    callback = LayerHealthCallback(
        every_n_steps=every, on_anomaly="ignore", sentinel=sentinel, output={"summary": False}
    )
    make_trainer([callback], max_steps=steps).fit(module)
    assert all(t.replayed for t in callback.trips)
    return calls


def test_the_trace_runs_only_in_the_replay_of_a_nonfinite_trip():
    # Each fit against the same fit without the sentinel (no trip, no replay): the same calls, under the same hooks.
    plain = hooks_per_call(TinyModule(data=make_data(n=256)), 8, 3, None)
    spiked = hooks_per_call(TinyModule(data=make_data(n=256)), 8, 3, force_trips({4}))
    # A loss spike on step 4: its replay runs training_step once more, under no hook of the trace; sampled steps 0,
    # 3 and 6 run under the hooks a fit without the sentinel installs, and no more.
    assert spiked == [*plain[:5], (4, plain[4][1]), *plain[5:]]

    plain = hooks_per_call(wrapped_module(), BAD_STEP + 1, 10, None)
    nan = hooks_per_call(wrapped_module(), BAD_STEP + 1, 10, "loss")
    assert nan == [*plain, (BAD_STEP, plain[BAD_STEP][1] + 1)]  # the NaN's replay, traced once


# ------------------------------------------------------------------------------------------------------ rule
def test_the_rule_names_the_origin_and_sorts_it_where_the_nan_entered():
    values = {"act_nonfinite": {"enc": 0.0, "mid": 6.0, "head": 6.0}, "act_dead_frac": {"head": 1.0}}
    trip = Trip(step=4, kind="nonfinite_loss", loss=float("nan"), replayed=True, nan_entry="mid", nan_origin="block")
    findings = run_rules(values, ["enc", "mid", "head"], [], step=4, trip=trip)
    assert [(f.rule, f.layer, f.stat) for f in findings] == [
        ("nonfinite", "block", "act_nonfinite"),
        ("dead_units", "head", "act_dead_frac"),
    ]
    assert_says(
        findings[0].message,
        "made inside the forward of block, after the output of enc and before the input of mid, at step 4",
        "not a selected layer",
        "mid, the first non-finite selected layer in forward order, received it (6 NaN/Inf output elements)",
    )
    # An entry that is not the first non-finite layer (another process saw it elsewhere): today's finding.
    other = Trip(step=4, kind="nonfinite_loss", loss=float("nan"), replayed=True, nan_entry="head", nan_origin="x")
    assert run_rules(values, ["enc", "mid", "head"], [], step=4, trip=other)[0].layer == "mid"


def test_a_compiled_model_is_traced_like_eager():
    # The replay runs compiled code eagerly (the hooks' force_eager stance), so the global hook sees every module;
    # names carry no _orig_mod.
    torch._dynamo.reset()
    module = wrapped_module()
    module.model = torch.compile(module.model, backend="eager")
    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    try:
        make_trainer([callback], max_steps=BAD_STEP + 1).fit(module)
    finally:
        torch._dynamo.reset()
    assert (callback.trips[0].nan_entry, callback.trips[0].nan_origin) == ("model.out", "model.scale")
    assert callback.findings[0].layer == "model.scale"
    assert count_hooks(module) == 0
