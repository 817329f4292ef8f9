"""The facts read at the step for the participation rules: how a layer's part in the sampled steps is counted."""

from __future__ import annotations

import random

import pytest
from torch import nn

from lightning_hookdiag._participation import RunRecord, model_picture, shadowed_attributes


def _record(pattern: str) -> RunRecord:
    record = RunRecord()
    for ran in pattern:
        record.update(ran == "x")
    return record


@pytest.mark.parametrize(
    ("pattern", "stopped"),
    [
        ("xxx...", True),  # ran 3, then none of 3
        ("xxx..", False),  # not yet: 3 absent are needed
        ("xx....", False),  # ran on 2 only
        ("xxxxx....", False),  # ran 5: as many absent are needed
        ("xxxxx.....", True),
        ("x" * 20 + "." * 7, False),  # at most 8 absent are needed, whatever it ran
        ("x" * 20 + "." * 8, True),
        ("x.xxx...", False),  # ran again after a miss: now and then, by design
        ("...xxx...", False),  # started late: not steady from the first sampled step
        ("xxx...x", False),  # ran again
    ],
)
def test_a_stop_is_a_steady_run_then_as_long_an_absence(pattern, stopped):
    assert _record(pattern).stopped is stopped


def test_layerdrop_at_a_usual_rate_is_almost_never_a_stop():
    # LayerDrop at p=0.1 over 50 sampled steps, 20000 layers: the chance is about (p (1 - p))**3 = 7.3e-4 per layer.
    rng = random.Random(0)
    fits = 20000
    stops = sum(_record("".join("." if rng.random() < 0.1 else "x" for _ in range(50))).stopped for _ in range(fits))
    assert stops / fits < 2e-3


def test_the_picture_changes_when_a_module_is_replaced_not_when_weights_change():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    before = model_picture(net)
    net[0].weight.data.mul_(2)
    assert model_picture(net) == before
    net[0] = nn.Linear(2, 2)
    assert model_picture(net) != before


def test_only_attributes_that_hide_a_tensor_method_or_property_are_reported():
    lin = nn.Linear(2, 1)
    lin.weight.requires_grad_ = True  # type: ignore[method-assign]
    lin.weight.zero_ = None  # type: ignore[method-assign]
    lin.bias.tag = "no decay"  # type: ignore[attr-defined]
    assert shadowed_attributes(dict(lin.named_parameters())) == {"weight": ("requires_grad_", "zero_")}
