"""The grouped constructor: ``measure=``, ``sentinel=``, ``rules=``, ``output=``, and the flat spellings it replaces."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import RecordingLogger, TinyModule, by_name, make_data, make_trainer

from lightning_hookdiag import (
    LayerHealthCallback,
    MeasureConfig,
    OutputConfig,
    RuleConfig,
    SentinelConfig,
)
from lightning_hookdiag._sentinel import SpikeDetector

P = "layer_health"
CHECKPOINT = Path(__file__).resolve().parent / "callback_before_config.ckpt"

# Every keyword of the flat constructor, a valid value for it, and the group that holds it now.
OLD = {
    "layer_types": (["torch.nn.Linear", "torch.nn.ReLU"], "measure"),
    "exclude": (["model.1"], "measure"),
    "extra_stats": (["act_kurtosis"], "measure"),
    "dead_unit_types": (["torch.nn.ReLU"], "measure"),
    "unit_dim": (-1, "measure"),
    "precision_targets": ("float16", "measure"),
    "output_layer": ("model.2", "measure"),
    "histogram_every_n_steps": (2, "measure"),
    "histogram_bins": (8, "measure"),
    "summary": (False, "output"),
    "charts": ("all", "output"),
    "heatmap_stats": (["act_std"], "output"),
    "heatmap_every_n_steps": (2, "output"),
}
CONFIGS = {"measure": "measure_config", "output": "output_config"}


def fit(callback: LayerHealthCallback, steps: int = 5) -> RecordingLogger:
    logger = RecordingLogger()
    torch.manual_seed(0)
    make_trainer([callback], max_steps=steps, logger=logger).fit(TinyModule(data=make_data(n=128)))
    return logger


# --------------------------------------------------------------------------------------------- old spellings
@pytest.mark.parametrize("name", list(OLD))
def test_each_flat_keyword_warns_naming_its_new_spelling_and_sets_the_same_field(name):
    value, group = OLD[name]
    extra = {"stats": ["act_mean", "logit_absmax"]} if name == "output_layer" else {}
    with pytest.warns(DeprecationWarning, match=re.escape(f"LayerHealthCallback({group}={{'{name}': ...}})")):
        old = LayerHealthCallback(every_n_steps=2, **extra, **{name: value})
    new = LayerHealthCallback(every_n_steps=2, **extra, **{group: {name: value}})
    assert getattr(old, CONFIGS[group]) == getattr(new, CONFIGS[group])
    assert getattr(new, CONFIGS[group]) != getattr(LayerHealthCallback(**extra), CONFIGS[group])  # the value took
    if name != "extra_stats":  # folded into stats, as before
        assert getattr(old, name) == getattr(new, name)  # the flat name still reads the setting


def test_the_flat_spellings_log_exactly_what_the_grouped_ones_log():
    old_kwargs = {
        "layer_types": ["torch.nn.Linear", "torch.nn.ReLU"],
        "exclude": ["model.2"],
        "extra_stats": ["act_kurtosis"],
        "unit_dim": -1,
        "histogram_every_n_steps": 2,
        "histogram_bins": 8,
        "summary": False,
        "charts": "all",
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = LayerHealthCallback(every_n_steps=2, rules={"spike_warmup": 3}, **old_kwargs)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == len(old_kwargs) + 1  # one per flat keyword, one for the rules' spike_warmup
    assert any("SentinelConfig.warmup" in message for message in deprecations)
    new = LayerHealthCallback(
        every_n_steps=2,
        measure=MeasureConfig(
            layer_types=["torch.nn.Linear", "torch.nn.ReLU"],
            exclude=["model.2"],
            extra_stats=["act_kurtosis"],
            unit_dim=-1,
            histogram_every_n_steps=2,
            histogram_bins=8,
        ),
        sentinel=SentinelConfig(warmup=3),
        output=OutputConfig(summary=False, charts="all"),
    )
    assert old.state_key == new.state_key
    old_logged, new_logged = fit(old).ours(), fit(new).ours()
    assert [step for step, _ in new_logged] == [0, 2, 4]
    assert old_logged == new_logged  # every key, every value, bit for bit
    # The settings took effect: model.2 excluded, kurtosis added; values checked against the tensors elsewhere.
    keys = set(by_name(dict(new_logged)[0]))
    assert f"{P}/act_kurtosis/model.0" in keys
    assert not [k for k in keys if k.endswith("/model.2")]
    assert old.trips == new.trips
    assert old.findings == new.findings


@pytest.mark.parametrize(
    ("kwargs", "facts"),
    [
        ({"unit_dim": 1, "measure": {"unit_dim": 2}}, ["unit_dim=1 (deprecated)", "MeasureConfig.unit_dim"]),
        ({"summary": False, "output": OutputConfig()}, ["summary= (deprecated)", "OutputConfig.summary there"]),
        (
            {"rules": {"spike_window": 30}, "sentinel": {"window": 40}},
            ["rules= (deprecated spike_* names)", "['window']", "keep only sentinel="],
        ),
        ({"rules": {"spike_window": 30}, "sentinel": SentinelConfig()}, ["['window'] (deprecated)", "SentinelConfig"]),
    ],
)
def test_a_setting_given_in_both_spellings_is_an_error(kwargs, facts):
    with warnings.catch_warnings(), pytest.raises(ValueError, match=re.escape(facts[0])) as error:
        warnings.simplefilter("ignore", DeprecationWarning)  # the rules' spike_* names warn before the error
        LayerHealthCallback(**kwargs)
    assert all(fact in str(error.value) for fact in facts), (facts, str(error.value))


def test_different_settings_in_both_spellings_are_merged():
    with pytest.warns(DeprecationWarning, match="exclude"):
        callback = LayerHealthCallback(exclude=["model.1"], measure={"unit_dim": 0})
    assert callback.measure_config == MeasureConfig(exclude=["model.1"], unit_dim=0)


def test_an_unknown_keyword_is_a_type_error_listing_the_arguments():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['every_n_step'\]; valid: every_n_steps"):
        LayerHealthCallback(every_n_step=2)


def test_arguments_after_layers_are_keyword_only():
    # The third positional argument was layer_types; it is now stats: a positional call fails instead of changing.
    with pytest.raises(TypeError, match="positional"):
        LayerHealthCallback(2, None, ["torch.nn.Linear"])  # type: ignore[misc]


def test_rule_config_keeps_the_spike_keywords_for_one_release_and_hands_them_to_the_sentinel():
    with pytest.warns(DeprecationWarning, match=r"RuleConfig's spike_warmup is deprecated.*SentinelConfig\.warmup"):
        rules = RuleConfig(spike_warmup=5, dead_frac_threshold=0.5)
    assert rules.deprecated_sentinel_settings() == {"warmup": 5}
    callback = LayerHealthCallback(rules=rules, sentinel="loss+grads")
    assert callback.sentinel_config == SentinelConfig(mode="loss+grads", warmup=5)
    with pytest.warns(DeprecationWarning, match="spike_window"):
        assert RuleConfig.from_mapping({"spike_window": 30}).deprecated_sentinel_settings() == {"window": 30}


# ----------------------------------------------------------------------------------------- the config objects
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MeasureConfig(unit_dim=1.5), "MeasureConfig.unit_dim: expected an integer axis or None, got 1.5"),
        (lambda: MeasureConfig(histogram_bins=5), "MeasureConfig.histogram_bins: expected an even integer >= 4, got 5"),
        (lambda: MeasureConfig(histogram_every_n_steps=0), "MeasureConfig.histogram_every_n_steps: expected None or"),
        (lambda: MeasureConfig(layer_types=["torch.nn.Lineer"]), "MeasureConfig.layer_types"),
        (lambda: MeasureConfig(dead_unit_types=[int]), "MeasureConfig.dead_unit_types"),
        (lambda: MeasureConfig(exclude=[""]), "MeasureConfig.exclude"),
        (lambda: MeasureConfig(extra_stats=["act_kurt"]), "MeasureConfig.extra_stats: unknown statistic(s)"),
        (lambda: MeasureConfig(precision_targets="fp16"), "MeasureConfig.precision_targets: unknown target(s)"),
        (lambda: MeasureConfig(output_layer=""), "MeasureConfig.output_layer: expected None or a non-empty module"),
        (lambda: SentinelConfig(mode="grads"), "SentinelConfig.mode: expected one of ['loss', 'loss+grads', None]"),
        (lambda: SentinelConfig(window=2), "SentinelConfig.window: expected an integer >= 3, got 2"),
        (lambda: SentinelConfig(window=10, warmup=11), "SentinelConfig.warmup: expected an integer in [3, window=10]"),
        (lambda: SentinelConfig(zscore=math.inf), "SentinelConfig.zscore: expected a finite number > 0, got inf"),
        (lambda: SentinelConfig(ratio=1), "SentinelConfig.ratio: expected a finite number > 1, got 1"),
        (lambda: SentinelConfig(floor=-0.1), "SentinelConfig.floor: expected a number in [0, 1), got -0.1"),
        (lambda: SentinelConfig(detector=object()), "SentinelConfig.detector: expected None or a SpikeDetector"),
        (
            lambda: SentinelConfig(window=30, detector=SpikeDetector()),
            "SentinelConfig: window configure the built spike test, but detector= replaces it",
        ),
        (lambda: OutputConfig(summary="yes"), "OutputConfig.summary: expected True or False, got 'yes'"),
        (lambda: OutputConfig(charts="some"), "OutputConfig.charts: expected one of ['default', 'all'], got 'some'"),
        (lambda: OutputConfig(heatmap_stats=["act_stdd"]), "OutputConfig.heatmap_stats: unknown statistic(s)"),
        (lambda: OutputConfig(heatmap_every_n_steps=-2), "OutputConfig.heatmap_every_n_steps: expected None or"),
    ],
)
def test_each_configuration_rejects_a_bad_field_naming_it(build, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 4, "output": {"heatmap_every_n_steps": 6}}, "OutputConfig.heatmap_every_n_steps: expected"),
        (
            {"stats": ["act_mean"], "measure": {"output_layer": "model.2"}},
            "MeasureConfig.output_layer='model.2' names the layer of",
        ),
        ({"measure": {"unit_dims": 1}}, "measure: unknown MeasureConfig field(s) ['unit_dims']; valid keys: ["),
        ({"sentinel": 3}, "sentinel: expected one of ['loss', 'loss+grads', None], a SentinelConfig or a mapping"),
        ({"sentinel": "grads"}, "sentinel: expected one of ['loss', 'loss+grads', None], got 'grads'"),
        ({"output": ["summary"]}, "output: expected a OutputConfig, a mapping of its fields or None, got ['summary']"),
    ],
)
def test_settings_checked_against_the_callbacks_own_are_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LayerHealthCallback(**kwargs)


def test_equal_settings_make_equal_configurations_whatever_their_spelling():
    assert MeasureConfig(layer_types="torch.nn.Linear", exclude="head") == MeasureConfig(
        layer_types=[torch.nn.Linear], exclude=("head",)
    )
    assert SentinelConfig(window=np.int64(30)) == SentinelConfig(window=30)  # stored as int: equal, and hashed alike
    assert hash(SentinelConfig(window=np.int64(30))) == hash(SentinelConfig(window=30))


# -------------------------------------------------------------------------------------------- the detector seam
class EveryThird(SpikeDetector):
    """Trips on the optimizer steps divisible by 3 (but 0), whatever the loss."""

    def observe(self, loss: float, step: int | None = None) -> bool:
        spike = super().observe(loss, step)
        return spike or (step is not None and step > 0 and step % 3 == 0)


def test_a_detector_passed_in_decides_the_trips_and_each_callback_uses_its_own_copy():
    config = SentinelConfig(mode="loss", detector=EveryThird(warmup=3))
    first, second = (LayerHealthCallback(every_n_steps=100, on_anomaly="ignore", sentinel=config) for _ in "ab")
    fit(first, steps=7)
    assert [(t.step, t.kind, t.replayed) for t in first.trips] == [(3, "loss_spike", True), (6, "loss_spike", True)]
    assert list(config.detector.losses) == []  # the configuration's detector is a template: untouched
    assert second.state_dict()["sentinel"]["losses"] == []  # the other callback's copy saw nothing
    # Every step's loss: the two trips' were healthy to the built-in test, which EveryThird runs first.
    assert len(first.state_dict()["sentinel"]["losses"]) == 7
    fit(second, steps=7)
    assert second.trips == first.trips


# -------------------------------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_written_before_the_grouped_constructor_resumes_with_the_new_spelling():
    # Written by the flat constructor at 71a15f9 (every_n_steps=2, exclude=["model.1"], spike_window=10, warmup=3;
    # a trip forced at step 3; 6 steps) with the TinyModule of tests/helpers/fit.py.
    saved = torch.load(CHECKPOINT, weights_only=False)
    key = "LayerHealthCallback{'every_n_steps': 2, 'layers': None, 'exclude': ['model.1'], 'prefix': 'layer_health'}"
    assert list(saved["callbacks"]) == [key]
    resumed = LayerHealthCallback(
        every_n_steps=2,
        on_anomaly="ignore",
        measure={"exclude": ["model.1"]},
        sentinel={"window": 10, "warmup": 3},
        output={"summary": False},
    )
    assert resumed.state_key == key
    logger = RecordingLogger()
    torch.manual_seed(0)
    make_trainer([resumed], max_steps=9, logger=logger).fit(TinyModule(data=make_data(n=64)), ckpt_path=CHECKPOINT)
    assert [step for step, _ in logger.ours()] == [6, 8]  # the schedule goes on from step 6
    assert [(t.step, t.kind) for t in resumed.trips] == [(3, "loss_spike")]  # restored: step 3 never ran here
    # The sentinel's baseline came back: the losses of steps 0-5 (the forced trip's was healthy), then 6-8 joined.
    restored = saved["callbacks"][key]["sentinel"]["losses"]
    assert len(restored) == 6
    assert resumed.state_dict()["sentinel"]["losses"][: len(restored)] == restored
    assert len(resumed.state_dict()["sentinel"]["losses"]) == 9
