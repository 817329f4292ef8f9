"""Opt-in statistics end to end: a real fit, read back from a CSVLogger, against float64 references."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import RecordingLogger, TinyModule, by_name, force_trips, make_data, make_trainer
from helpers.reference import flat, outlier_reference, precision_counts, replay_sequential
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_hookdiag import OPT_IN_STATS, LayerHealthCallback
from lightning_hookdiag.report import read_health_log

P = "layer_health"
TARGETS = {"float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}


def loud_module() -> TinyModule:
    # The first layer's weights are scaled so that its outputs reach the hundreds: past float8_e4m3fn's 448 / 2.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.mul_(200.0)
    return TinyModule(model=model, data=make_data(n=24), batch_size=5, lr=1e-6)


def test_every_opt_in_statistic_read_back_from_csv_matches_float64(tmp_path):
    module = loud_module()
    callback = LayerHealthCallback(
        every_n_steps=2, stats=list(OPT_IN_STATS), on_anomaly="ignore", measure={"precision_targets": list(TARGETS)}
    )
    trainer = make_trainer([callback], max_steps=3, accumulate_grad_batches=2, logger=CSVLogger(tmp_path))
    trainer.fit(module)
    log = read_health_log(trainer.logger.log_dir)
    assert log.steps == (0, 2)
    expected_stats = {"act_kurtosis", "act_absmax_over_std", "act_saved_bytes"}  # the precursors are default now
    expected_stats |= {f"{kind}_{t}" for kind in ("act_underflow_frac", "act_overflow_frac") for t in TARGETS}
    expected_stats |= {f"act_grad_{kind}_{t}" for kind in ("underflow_frac", "overflow_frac") for t in TARGETS}
    assert set(log.stats) == expected_stats  # nothing of the default set: stats= replaced it
    for step in log.steps:
        outputs, grads, _, _ = replay_sequential(module, step, accumulate=2)
        for i in range(3):
            layer = f"model.{i}"

            def logged(stat: str, layer: str = layer, step: int = step) -> float:
                return log.stats[stat][layer][step]

            for key, value in outlier_reference(outputs[i]).items():
                assert logged(key) == pytest.approx(value, rel=1e-6), (step, layer, key)
            for kind, tensors in (("act", outputs[i]), ("act_grad", grads[i])):
                for name, dtype in TARGETS.items():
                    nonzero, under, over = precision_counts(flat(tensors), dtype)
                    assert logged(f"{kind}_underflow_frac_{name}") == pytest.approx(under / nonzero, abs=1e-12)
                    assert logged(f"{kind}_overflow_frac_{name}") == pytest.approx(over / nonzero, abs=1e-12)
            rows = [len(t) for t in outputs[i]]
            per_row = {0: 4, 1: 8, 2: 0}[i] * 4  # Linear: its input; ReLU: its output; the head: nothing new
            assert logged("act_saved_bytes") == max(rows) * per_row
    # The planted scale is seen: a share of the first layer's outputs is at risk in fp8, none in fp16.
    assert log.stats["act_overflow_frac_float8_e4m3fn"]["model.0"][0] > 0
    assert log.stats["act_overflow_frac_float16"]["model.0"][0] == 0.0
    risky = [(f.layer, f.stat) for f in callback.findings if f.rule == "precision_headroom"]
    assert ("model.0", "act_overflow_frac_float8_e4m3fn") in risky
    assert not [f for f in risky if f[1].endswith("float16")]


def test_precision_headroom_warns_naming_layer_and_target():
    callback = LayerHealthCallback(
        every_n_steps=1, stats=["act_overflow_frac"], measure={"precision_targets": "float8_e4m3fn"}
    )
    with pytest.warns(UserWarning, match=r"precision_headroom: .* of the non-zero outputs of model\.0 at step 0 would"
                      r" overflow float8_e4m3fn"):  # fmt: skip
        make_trainer([callback], max_steps=1).fit(loud_module())


def test_default_target_follows_bf16_mixed():
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_underflow_frac", "act_grad_overflow_frac"])
    make_trainer([callback], max_steps=1, precision="bf16-mixed", logger=logger).fit(TinyModule())
    keys = {k.split("/")[1] for _, m in logger.ours() for k in m if "/depth/" not in k}
    assert keys == {"act_underflow_frac_bfloat16", "act_grad_overflow_frac_bfloat16"}


def test_full_precision_without_targets_computes_nothing_and_says_how(caplog):
    logger = RecordingLogger()
    callback = LayerHealthCallback(every_n_steps=1, stats=["act_mean", "act_overflow_frac"])
    with caplog.at_level(logging.INFO):
        make_trainer([callback], max_steps=2, logger=logger).fit(TinyModule())
    keys = {k.split("/")[1] for _, m in logger.ours() for k in m}
    assert keys == {"act_mean"}  # no opt-in statistic, no depth scalar (the depth is in the keys)
    notes = [r.getMessage() for r in caplog.records if "precision headroom" in r.getMessage()]
    assert len(notes) == 1
    assert "32-true precision" in notes[0]
    assert "pass precision_targets=" in notes[0]


def test_bad_precision_targets_fail_at_construction():
    with pytest.raises(ValueError, match=r"precision_targets: unknown target\(s\) \['int8'\]"):
        LayerHealthCallback(stats=["act_overflow_frac"], measure={"precision_targets": ["int8"]})
    with pytest.raises(ValueError, match=r"stats: unknown statistic\(s\) \['act_kurt'\]; expected names from"):
        LayerHealthCallback(stats=["act_kurt"])


def test_training_is_bit_identical_with_every_opt_in_statistic():
    final = []
    for callbacks in (
        [],
        [LayerHealthCallback(every_n_steps=1, stats=list(OPT_IN_STATS), measure={"precision_targets": "float16"})],
    ):
        torch.manual_seed(0)
        module = TinyModule(model=nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1)))
        make_trainer(callbacks, max_steps=3, accumulate_grad_batches=2).fit(module)
        final.append(module.model.state_dict())
    for key in final[0]:
        assert torch.equal(final[0][key], final[1][key]), key


def test_nan_parameter_gradients_are_still_logged_but_undefined_opt_in_values_are_not():
    module = TinyModule()
    with torch.no_grad():
        module.model[2].weight[0, 0] = float("nan")  # every output, loss and gradient of the step is NaN
    callback = LayerHealthCallback(every_n_steps=1, stats=["param_grad_norm", "act_kurtosis"], on_anomaly="ignore")
    make_trainer([callback], max_steps=1).fit(module)
    metrics = by_name(callback.last_metrics)
    assert math.isnan(metrics[f"{P}/param_grad_norm/model.0.weight"])  # a default statistic: NaN is the finding
    assert f"{P}/act_kurtosis/model.0" in metrics  # finite outputs before the NaN weight
    assert f"{P}/act_kurtosis/model.2" not in metrics  # no finite output: undefined, not logged
    assert [f.rule for f in callback.findings] == ["nonfinite"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_replayed_step_logs_the_opt_in_values_a_sampled_step_logs(monkeypatch, accumulate):
    from helpers.dropping import fit_dropping

    def opt_in(every: int, **kwargs) -> LayerHealthCallback:
        stats = list(OPT_IN_STATS)
        measure, output = {"precision_targets": "float16"}, {"summary": False}
        return LayerHealthCallback(
            every_n_steps=every, stats=stats, on_anomaly="ignore", measure=measure, output=output, **kwargs
        )

    regular_log = RecordingLogger()
    fit_dropping([opt_in(3, sentinel=None)], regular_log, accumulate_grad_batches=accumulate)
    replay_log = RecordingLogger()
    callback = opt_in(100, sentinel=force_trips({3}))
    fit_dropping([callback], replay_log, accumulate_grad_batches=accumulate)
    regular, replayed = dict(regular_log.ours())[3], dict(replay_log.ours())[3]
    assert callback.trips[0].replayed
    assert set(regular) == set(replayed)
    assert f"{P}/act_saved_bytes/model.0" in replayed
    for key, value in regular.items():
        assert replayed[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
