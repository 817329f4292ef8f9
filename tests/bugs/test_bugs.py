"""The bug benchmark: each ordinary training bug of ``cases.py`` is reported by its rule on its layer, and its fixed
twin raises nothing.

Blind spots and known misses (``rule=None``) must say exactly what they say today (``Case.today``, mostly nothing),
so that a rule that learns to see one moves it out of the misses on purpose; a twin's known false alarm is on record
the same way (``Case.twin_today``).
"""

from __future__ import annotations

import pytest
import torch
from cases import BY_NAME, CASES, PRINCIPLES, BugModule, Case, Fit, _mlp, run
from helpers import by_name
from torch.utils.data import TensorDataset

from lightning_hookdiag.rules import RULES

pytestmark = pytest.mark.slow

DETECTABLE = [case for case in CASES if case.rule is not None]
BLIND = [case for case in CASES if case.rule is None]


@pytest.mark.parametrize("case", DETECTABLE, ids=lambda c: c.name)
def test_the_bug_is_reported_by_its_rule_on_its_layer(case, record_property):
    callback = run(case, sick=True)
    hits = [f for f in callback.findings if f.rule == case.rule and f.layer == case.layer]
    assert hits, [(f.rule, f.layer, f.step) for f in callback.findings]
    record_property("step", hits[0].step)  # on which step the user hears of it
    if case.step is not None:
        assert hits[0].step == case.step, hits[0].message
    assert 0 <= hits[0].step < case.max_steps


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_fixed_twin_raises_nothing(case):
    callback = run(case, sick=False)
    if case.twin_today:  # a known false alarm, on record with its reason (case.blind, case.twin_note)
        assert {(f.rule, f.layer) for f in callback.findings} == set(case.twin_today)
        return
    assert [f.message for f in callback.findings] == []
    assert callback.trips == []


@pytest.mark.parametrize("case", BLIND, ids=lambda c: c.name)
def test_a_blind_spot_stays_blind(case):
    # A known miss says exactly what it says today; if a rule starts to see it, give the case its rule and layer: the
    # benchmark counts it then.
    callback = run(case, sick=True)
    assert {(f.rule, f.layer) for f in callback.findings} == set(case.today), [f.message for f in callback.findings]
    if not case.today:
        assert callback.findings == []
    assert case.blind


# Every bug reruns with the default interval, for at least one step past the first sampled step that compares with
# an earlier one (50): a bug present from the start is named on step 0, or on step 50 by the rules that compare with
# the previous sampled step; a miss there is on record with what was measured (Case.default_note).
@pytest.mark.parametrize("case", DETECTABLE, ids=lambda c: c.name)
def test_with_the_default_interval(case):
    steps = max(case.max_steps, 51)
    callback = run(case, sick=True, max_steps=steps, every_n_steps=50)
    hits = [f.step for f in callback.findings if f.rule == case.rule and f.layer == case.layer]
    if case.default_step is None:
        assert hits == [], [f.message for f in callback.findings]
        assert case.default_note
    else:
        assert hits[:1] == [case.default_step], [f.message for f in callback.findings]


def test_the_library_is_consistent():
    names = [case.name for case in CASES]
    assert len(names) == len(set(names))
    assert len([case for case in CASES if not case.source]) >= 50  # the TrainCheck ports are counted apart
    for case in CASES:
        assert case.principle in PRINCIPLES, case.name
        assert not case.twin_today or case.blind or case.twin_note, case.name  # a twin's false alarm is explained
    for case in DETECTABLE:
        assert case.rule in RULES, case.name
        assert case.layer
        assert not case.blind
        assert not case.today
    for case in BLIND:
        assert case.blind, case.name  # the layer, when set, is where a right diagnosis points


def test_a_head_left_out_of_the_optimizer_is_one_finding_and_stale_gradients_names_it_without_not_updated():
    # zero_grad() clears only the optimizer's param groups, so the head's .grad also adds up from step to step.
    # not_updated says why exactly; stale_gradients leaves it to that rule, and names it when that rule is off.
    callback = run(BY_NAME["head_not_in_optimizer"], sick=True)
    assert {(f.rule, f.layer) for f in callback.findings} == {("not_updated", "model.head")}
    rules = [r for r in RULES if r != "not_updated"]
    callback = run(BY_NAME["head_not_in_optimizer"], sick=True, rules={"enabled": rules})
    (f,) = [f for f in callback.findings if f.rule == "stale_gradients"]
    assert (f.layer, f.step, f.value) == ("model.head", 1, 2.0)  # model.head.weight and model.head.bias
    assert "none of the optimizer's param groups" in f.message


def test_input_scale_is_silent_on_pixels_scaled_to_0_1_without_standardising():
    # ToTensor without Normalize: inputs in [0, 1] are not a bug worth a finding (first-layer RMS ~0.3).
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (64, 64), generator=g).float() / 255.0
    data = TensorDataset(pixels, (pixels[:, :32].mean(1) > pixels[:, 32:].mean(1)).long())
    case = Case(
        "pixels_0_1", "", lambda sick: Fit(BugModule(_mlp(64, 32, d_out=2), data, loss="ce", lr=0.01)), None, None
    )
    callback = run(case, sick=True, max_steps=3)
    assert callback.findings == []
    rms = (
        by_name(callback.last_metrics)["layer_health/act_mean/model.0"] ** 2
        + by_name(callback.last_metrics)["layer_health/act_std/model.0"] ** 2
    ) ** 0.5
    assert rms < 1.0
