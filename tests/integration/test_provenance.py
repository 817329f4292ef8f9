"""NaN provenance: a NaN made by functional code between two selected layers is named at the module that made it."""

from __future__ import annotations

import pytest
import torch
from conftest import RecordingLogger, TinyModule, count_hooks, force_trips, make_data, make_trainer, run_rules
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthError, replay
from lightning_hookdiag import sentinel as SN
from lightning_hookdiag.provenance import NonFiniteTrace
from lightning_hookdiag.rules import LOSS, ROOT
from lightning_hookdiag.step_state import Trip

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


def wrapped_module() -> TinyModule:
    torch.manual_seed(0)  # the same initial weights for every instance
    module = TinyModule(data=make_data(n=256), lr=0.01)
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


def test_a_nan_made_on_a_sampled_step_is_traced_by_a_re_run_that_adds_nothing_to_its_statistics(monkeypatch):
    # BAD_STEP is sampled (every step is): the hooks saw it as it happened, and a re-run through the trace alone
    # names the wrapper. Without the re-run the same step logs the same values: the re-run was not counted.
    logged = {}
    for traced in (True, False):
        if not traced:
            # The re-run through the trace runs no training_step.
            monkeypatch.setattr(replay.LightningStep, "micro_batch_loss", lambda self, micro: None)
        module = wrapped_module()
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
def test_the_trace_runs_only_in_the_replay_of_a_nonfinite_trip(monkeypatch):
    attached: list[int] = []
    original = NonFiniteTrace.attach

    def counting(self):
        attached.append(1)
        original(self)

    monkeypatch.setattr(NonFiniteTrace, "attach", counting)
    # a loss spike on step 4: replayed, not traced
    callback = LayerHealthCallback(
        every_n_steps=3, on_anomaly="ignore", sentinel=force_trips({4}), output={"summary": False}
    )
    make_trainer([callback], max_steps=8).fit(TinyModule(data=make_data(n=256)))
    assert [t.step for t in callback.trips if t.replayed] == [4]
    assert attached == []  # sampled steps 0, 3, 6 and the spike's replay: no trace

    callback = LayerHealthCallback(every_n_steps=10, on_anomaly="ignore", output={"summary": False})
    make_trainer([callback], max_steps=BAD_STEP + 1).fit(wrapped_module())
    assert attached == [1]


def test_the_global_hook_is_removed_when_the_replay_raises():
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    hooks = SN.HookSet({"0": net[0]}, lambda i, out: None)
    trace = NonFiniteTrace(net)
    micro = SN.MicroBatch(torch.randn(5, 3), 0, SN.capture_rng(torch.device("cpu")))

    def run(m):
        net(m.batch)
        assert len(torch.nn.modules.module._global_forward_hooks) == 1
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        SN.replay_step([micro], run, net, hooks, torch.device("cpu"), trace)
    assert count_hooks(net) == 0
    assert len(torch.nn.modules.module._global_forward_hooks) == 0


def test_the_trace_prefers_a_nan_and_ignores_keyword_masks():
    class Mask(nn.Module):  # builds a -inf mask from finite inputs, on purpose
        def forward(self, x):
            return torch.full_like(x, float("-inf")).triu(1)

    class Attend(nn.Module):
        def forward(self, x, mask=None):
            return x + mask.nan_to_num(neginf=0.0)

    class Sqrt(nn.Module):
        def forward(self, x):
            return torch.sqrt(x - 10.0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.mask, self.attend, self.sqrt, self.head = Mask(), Attend(), Sqrt(), nn.Linear(3, 3)

        def forward(self, x):
            return self.head(self.sqrt(self.attend(x, mask=self.mask(x))))

    model = Model()
    trace = NonFiniteTrace(model)
    trace.attach()
    model(torch.ones(3, 3))
    trace.remove()
    # attend got a -inf mask by keyword: its input counts as finite; mask's -inf is not the NaN sqrt made.
    assert trace.origin(["attend", "head"]) == ("head", "sqrt")
    assert trace.origin(["head"]) == (None, None)  # one read: the record is consumed


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


def test_the_trace_formats_no_path_for_a_module_call():
    class Key(str):
        formatted = 0

        def __repr__(self) -> str:
            Key.formatted += 1
            return super().__repr__()

    class Named(nn.Module):
        def forward(self, x):
            return {Key("y"): x * float("nan")}

    model = nn.Sequential(Named())
    trace = NonFiniteTrace(model)
    trace.attach()
    try:
        model(torch.ones(2))
    finally:
        trace.remove()
    assert trace.origin(["0"]) == (None, None)  # the layer made it itself
    assert Key.formatted == 0  # the replay's hook runs on every module call: it builds no throw-away strings
