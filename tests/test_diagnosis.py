"""The callback acting on health findings: warn / raise / stop / ignore, the end-of-fit summary, resume."""

import logging

import pytest
import torch
from conftest import RecordingLogger, TinyModule, count_hooks, make_data, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_hookdiag import LayerHealthCallback, LayerHealthError, LayerHealthWarning


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
    quiet = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", summary=False)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        make_trainer([quiet], max_steps=1).fit(sick_module())
    assert "LayerHealthCallback: step" not in caplog.text


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
