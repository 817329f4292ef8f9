"""The rules' memory between steps (``Diagnosis``, by hand), and the callback acting on its findings: warn / raise /
stop / ignore, the end-of-fit summary, resume."""

import inspect
import json
import logging
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import RecordingLogger, TinyModule, count_hooks, force_trips, make_data, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthError, LayerHealthWarning
from lightning_hookdiag._diagnosis import Diagnosis
from lightning_hookdiag._step_state import Trip
from lightning_hookdiag.rules import LOSS, Observed, RuleConfig

# ------------------------------------------------------------------------------------ the Diagnosis, by hand
REPO = Path(__file__).resolve().parents[2]
DEAD = {"act_dead_frac": {"relu": 1.0}}
ALIVE = {"act_dead_frac": {"relu": 0.0}}


def spike(step: int) -> Trip:
    return Trip(step=step, kind="loss_spike", loss=40.0, baseline=1.0, replayed=True)


def observed(step: int, forward: list[str], trip: Trip | None = None, values: Any = None, **facts: Any) -> Observed:
    """Step ``step`` as the callback hands it over: its values, and its facts by name."""
    return Observed(step, values or {}, {"forward_order": forward, "trip": trip, **facts})


def test_step_takes_the_step_as_one_typed_observed_step():
    assert list(inspect.signature(Diagnosis.step).parameters) == ["self", "observed"]
    assert inspect.signature(Diagnosis.step).parameters["observed"].annotation == "Observed"
    with pytest.raises(TypeError, match="history"):  # the memory is the Diagnosis's own, not the caller's
        Diagnosis(RuleConfig()).step(observed(0, ["relu"], values=DEAD), history=None)  # type: ignore[call-arg]
    # The facts of the step reach the rules: a BatchNorm in eval mode, an output cut off from the gradient.
    facts = {"eval_mode": {"bn": "BatchNorm1d"}, "missing_grads": ["fc"], "backward_order": ["relu"]}
    found = Diagnosis(RuleConfig()).step(observed(0, ["fc", "bn", "relu"], **facts, values=ALIVE)).findings
    assert {(f.rule, f.layer) for f in found} == {("eval_mode", "bn"), ("no_gradient", "fc")}


def test_a_finding_is_new_once_while_it_persists_and_again_after_it_clears():
    diagnosis = Diagnosis(RuleConfig())
    steps = [(0, DEAD), (2, DEAD), (4, ALIVE), (6, DEAD)]
    seen = [diagnosis.step(observed(step, ["relu"], values=values)) for step, values in steps]
    assert [[(f.rule, f.layer, f.step) for f in d.findings] for d in seen] == [
        [("dead_units", "relu", 0)],
        [("dead_units", "relu", 2)],
        [],
        [("dead_units", "relu", 6)],
    ]
    assert [[f.step for f in d.new] for d in seen] == [[0], [], [], [6]]
    assert seen[0].new == seen[0].findings  # the very findings, not copies
    assert diagnosis.alerts.counts["dead_units"] == 3  # every finding counts, alerted or not
    assert diagnosis.alerts.state_dict()["active"] == [["dead_units", "relu"]]


def test_every_loss_spike_is_new():
    diagnosis = Diagnosis(RuleConfig())
    values = {"act_absmax": {"fc": 1.0}}
    news = [diagnosis.step(observed(s, ["fc"], spike(s), values=values)).new for s in (3, 4)]
    assert [[(f.rule, f.layer, f.step) for f in new] for new in news] == [
        [("loss_spike", LOSS, 3)],
        [("loss_spike", LOSS, 4)],
    ]


def test_the_baseline_is_the_last_step_without_a_trip():
    diagnosis = Diagnosis(RuleConfig())
    regular = {"act_absmax": {"fc": 1.0}}
    assert diagnosis.step(observed(0, ["fc"], values=regular)).findings == []
    assert diagnosis.baseline.step == 0
    assert diagnosis.baseline.values is regular
    diagnosis.step(observed(2, ["fc"], spike(2), values={"act_absmax": {"fc": 100.0}}))
    assert diagnosis.baseline.step == 0  # a tripped step is no baseline
    # Compared with step 0 (1.0), not with the tripped step 2 (100.0): a 50x growth names the layer.
    (finding,) = diagnosis.step(observed(4, ["fc"], spike(4), values={"act_absmax": {"fc": 50.0}})).findings
    assert (finding.rule, finding.layer, finding.value, finding.stat) == ("loss_spike", "fc", 50.0, "act_absmax")
    assert "grew 50x since step 0" in finding.message
    diagnosis.step(observed(6, ["fc"], values={"act_absmax": {"fc": 2.0}}))
    assert diagnosis.baseline.step == 6


def test_last_finite_follows_only_finite_weight_norms():
    diagnosis = Diagnosis(RuleConfig())
    diagnosis.step(observed(1, ["fc"], values={"param_norm": {"fc.weight": 1.0, "fc.bias": 2.0}}))
    diagnosis.step(observed(3, ["fc"], values={"param_norm": {"fc.weight": math.nan, "fc.bias": 2.0}}))
    assert diagnosis.last_finite == {"fc.weight": 1, "fc.bias": 3}
    (finding,) = diagnosis.step(
        observed(5, ["fc"], values={"param_norm": {"fc.weight": math.inf, "fc.bias": math.nan}})
    ).findings
    assert diagnosis.last_finite == {"fc.weight": 1, "fc.bias": 3}
    assert (finding.rule, finding.layer, finding.value) == ("nonfinite", "fc", 2.0)
    assert "they were last observed finite at step 3" in finding.message  # the later of the two


def test_each_step_goes_into_the_history_after_the_rules_ran():
    diagnosis = Diagnosis(RuleConfig(trend_window=5))
    assert diagnosis.history.window == 20  # logit_drift looks back 4 trend windows
    for step, norm in [(0, 1.0), (2, math.nan), (4, 3.0)]:
        diagnosis.step(observed(step, ["fc"], values={"param_norm": {"w": norm}}))
    assert diagnosis.history.points("param_norm", "w") == [(0, 1.0), (4, 3.0)]


def test_the_state_dict_round_trips_through_json_without_the_baseline():
    diagnosis = Diagnosis(RuleConfig())
    diagnosis.step(observed(0, ["relu"], values={**DEAD, "param_norm": {"w": 1.0}}))
    diagnosis.step(observed(2, ["relu"], values={**DEAD, "param_norm": {"w": math.nan}}))
    state = diagnosis.state_dict()
    assert list(state) == ["alerts", "last_finite", "history"]
    # The NaN norm of w (a parameter of no known layer: its own owner) is a nonfinite finding too.
    assert state["alerts"]["active"] == [["dead_units", "relu"], ["nonfinite", "w"]]
    assert (state["alerts"]["counts"]["dead_units"], state["alerts"]["counts"]["nonfinite"]) == (2, 1)
    assert state["last_finite"] == {"w": 0}
    assert state["history"]["points"]["param_norm"] == {"w": [[0, 1.0]]}
    restored = Diagnosis(RuleConfig())
    restored.load_state_dict({**json.loads(json.dumps(state)), "trips": []})  # the callback's other keys are ignored
    assert restored.state_dict() == state
    assert restored.baseline is None
    assert restored.step(observed(4, ["relu"], values=DEAD)).new == []  # restored as active: no repeated alert
    empty = Diagnosis(RuleConfig())
    empty.load_state_dict({})
    assert empty.state_dict() == Diagnosis(RuleConfig()).state_dict()


def test_a_resumed_baseline_is_the_last_logged_step_unless_it_tripped():
    metrics = {"layer_health/act_absmax/fc": 2.0, "layer_health/depth/fc": 0.0}
    restored = Diagnosis(RuleConfig())
    restored.load_state_dict({"last_step": 6, "last_metrics": metrics, "trips": [{"step": 3}]})
    assert restored.baseline.step == 6
    assert restored.baseline.values["act_absmax"] == {"fc": 2.0}
    (finding,) = restored.step(observed(8, ["fc"], spike(8), values={"act_absmax": {"fc": 100.0}})).findings
    assert "grew 50x since step 6" in finding.message
    tripped = Diagnosis(RuleConfig())
    tripped.load_state_dict({"last_step": 6, "last_metrics": metrics, "trips": [{"step": 6}]})
    assert tripped.baseline is None  # the values of a tripped step are no baseline
    other = Diagnosis(RuleConfig())
    other.load_state_dict({"last_step": 6, "last_metrics": {"run/act_absmax/fc": 2.0}}, prefix="run")
    assert other.baseline.values == {"act_absmax": {"fc": 2.0}}


def test_a_malformed_state_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"'active' expects \[rule, layer\] pairs, got 'dead_units'"):
        Diagnosis(RuleConfig()).load_state_dict({"alerts": {"active": ["dead_units"]}})
    with pytest.raises(ValueError, match=r"param_norm/w expects \[\[step, value\], ...\], got 5"):
        Diagnosis(RuleConfig()).load_state_dict({"history": {"points": {"param_norm": {"w": 5}}}})


def test_only_a_nonfinite_trip_with_the_nonfinite_rule_on_is_traced():
    nan, grad = Trip(step=1, kind="nonfinite_loss", loss=math.nan), Trip(step=1, kind="nonfinite_grad", loss=1.0)
    assert [Diagnosis(RuleConfig()).traces(t) for t in (nan, grad, spike(1))] == [True, True, False]
    assert not Diagnosis(RuleConfig(enabled=["dead_units", "loss_spike"])).traces(nan)


def test_the_diagnosis_runs_without_importing_torch_or_lightning(tmp_path):
    # The package's __init__ imports the callback (torch, Lightning); a stand-in parent package isolates the module.
    script = textwrap.dedent(
        f"""
        import sys, types
        parent = types.ModuleType("lightning_hookdiag")
        parent.__path__ = [{str(REPO / "lightning_hookdiag")!r}]
        sys.modules["lightning_hookdiag"] = parent
        from lightning_hookdiag._diagnosis import Diagnosis
        from lightning_hookdiag.rules import Observed, RuleConfig
        step = Observed(0, {{"act_dead_frac": {{"relu": 1.0}}}}, {{"forward_order": ["relu"]}})
        found = Diagnosis(RuleConfig()).step(step)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "lightning_fabric"))
        print("RESULT", [f.rule for f in found.new], heavy)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "RESULT ['dead_units'] []" in done.stdout


# ---------------------------------------------------------------------------------- the callback acting on it


class NaNAfter(nn.Module):
    """Identity until ``step`` forward calls have happened, then NaN in every output."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls > self.after else x


def sick_module(after: int = 0) -> TinyModule:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), NaNAfter(after), nn.Linear(8, 1))
    # A frozen prefix keeps NaN gradients out of the weights before the sick layer, so model.3 stays the origin on
    # every step instead of NaN weights making model.0 the origin from the second sick step on.
    for p in model[:3].parameters():
        p.requires_grad_(False)
    module = TinyModule(model=model, data=make_data(n=64))
    module.record_enabled = False
    return module


def test_raise_names_the_origin_layer_and_leaves_no_hooks():
    module = sick_module()
    with pytest.raises(LayerHealthError, match=r"at step 0 in model\.3 \(rule nonfinite\)") as info:
        make_trainer([LayerHealthCallback(every_n_steps=1, on_anomaly="raise")], max_steps=3).fit(module)
    assert "in model.4 (rule" not in str(info.value)  # downstream layers are not the origin
    assert count_hooks(module) == 0


def test_warn_once_per_rule_and_layer_until_it_clears():
    callback = LayerHealthCallback(every_n_steps=1)
    with pytest.warns(LayerHealthWarning) as record:
        make_trainer([callback], max_steps=4).fit(sick_module())
    ours = [str(w.message) for w in record if "nonfinite" in str(w.message)]
    # Forward origin model.3 and the backward origin: each warned once although all 4 steps are sick.
    assert sum("in model.3" in m for m in ours) == 1
    assert len(callback.findings) == len({(f.rule, f.layer) for f in callback.findings})
    assert {f.step for f in callback.findings} == {0}
    assert all(f.step == 3 for f in callback.last_findings)
    assert callback.last_findings[0].layer == "model.3"


def test_stop_ends_training_gracefully():
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="stop")
    trainer = make_trainer([callback], max_steps=20)
    with pytest.warns(LayerHealthWarning) as record:
        trainer.fit(sick_module(after=8))  # healthy for 8 forward calls: steps 0..7
    assert any("in model.3 at step 8" in str(w.message) for w in record)
    assert trainer.global_step == 9  # stopped right after the first sick step (step 8)
    assert callback.last_findings[0].step == 8


def test_ignore_records_without_warning():
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    make_trainer([callback], max_steps=2).fit(sick_module())  # any LayerHealthWarning would fail the test
    assert callback.findings
    assert callback.findings[0].rule == "nonfinite"


def test_rules_configuration_is_validated_and_applied():
    with pytest.raises(
        ValueError, match=r"on_anomaly: expected one of \['warn', 'raise', 'stop', 'ignore'\], got 'log'"
    ):
        LayerHealthCallback(on_anomaly="log")
    with pytest.raises(ValueError, match=r"unknown rule setting\(s\) \['dead_threshold'\]"):
        LayerHealthCallback(rules={"dead_threshold": 0.5})
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", rules={"enabled": ["dead_units"]})
    make_trainer([callback], max_steps=1).fit(sick_module())
    assert callback.findings == []  # nonfinite switched off


def test_healthy_network_has_no_findings():
    torch.manual_seed(0)
    module = TinyModule(data=make_data(n=256), batch_size=32, optimizer="adam", lr=0.01)
    callback = LayerHealthCallback(every_n_steps=2)
    make_trainer([callback], max_steps=20).fit(module)
    assert callback.findings == []


def test_end_of_fit_summary_in_depth_order_with_findings(caplog):
    callback = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore")
    with caplog.at_level(logging.INFO):
        make_trainer([callback], max_steps=2).fit(sick_module())
    text = caplog.text
    assert "LayerHealthCallback: step 1" in text
    rows = [line.split() for line in callback.summary_table().splitlines()[2:]]
    assert [r[1] for r in rows] == [f"model.{i}" for i in range(5)]
    assert rows[3][-1] == "nonfinite"
    quiet = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", output={"summary": False})
    caplog.clear()
    with caplog.at_level(logging.INFO):
        make_trainer([quiet], max_steps=1).fit(sick_module())
    assert "LayerHealthCallback: step" not in caplog.text


def test_a_spike_right_after_a_resume_is_compared_with_the_layers_before_the_checkpoint(tmp_path, monkeypatch):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=3)
    torch.manual_seed(0)
    make_trainer([LayerHealthCallback(every_n_steps=5), checkpoint], max_steps=3, enable_checkpointing=True).fit(
        TinyModule(data=make_data(n=64))
    )
    # A trip on step 4: not sampled, replayed.
    resumed = LayerHealthCallback(every_n_steps=5, on_anomaly="ignore", sentinel=force_trips({4}))
    torch.manual_seed(0)
    make_trainer([resumed], max_steps=5).fit(TinyModule(data=make_data(n=64)), ckpt_path=tmp_path / "last.ckpt")
    (finding,) = [f for f in resumed.findings if f.rule == "loss_spike"]
    assert finding.step == 4
    # Before, the baseline was not restored: "no earlier sampled step to compare the layers with".
    assert "since step 0" in finding.message


def test_resume_from_checkpoint_continues_schedule_and_alerts(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=3)
    first = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore")
    make_trainer([first, checkpoint], max_steps=3, enable_checkpointing=True).fit(sick_module())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    state = saved["callbacks"][first.state_key]
    assert state["last_step"] == 2
    assert all(not isinstance(v, torch.Tensor) for v in state["last_metrics"].values())

    logger = RecordingLogger()
    second = LayerHealthCallback(every_n_steps=2, on_anomaly="ignore")
    make_trainer([second], max_steps=7, logger=logger).fit(sick_module(), ckpt_path=tmp_path / "last.ckpt")
    assert [s for s, _ in logger.ours()] == [4, 6]  # the schedule continues from global_step 3
    assert second.findings[: len(first.findings)] == first.findings  # alert history restored
    assert len(second.findings) == len(first.findings)  # still active: no repeated alert after resuming
    # The checkpoint restores the rules' memory after setup() reset it: step 0's weights were the last finite ones
    # (NaN gradients broke them at its update), in the first fit.
    restored = second.state_dict()
    assert restored["last_finite"] == {"model.4.weight": 0, "model.4.bias": 0}
    assert [s for s, _ in restored["history"]["points"]["param_norm"]["model.4.weight"]] == [0]
    assert list(state) == [  # the checkpoint format of every earlier version
        "last_metrics",
        "last_step",
        "warned",
        "alerts",
        "findings",
        "trips",
        "sentinel",
        "last_finite",
        "history",
    ]
    assert {k: state[k] for k in ("alerts", "last_finite", "history")} == first._diagnosis.state_dict()
