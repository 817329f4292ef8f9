"""Precision headroom: exact counts on both sides of every threshold, for every target and input dtype."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reference import precision_counts

from lightning_hookdiag import _precision as PR
from lightning_hookdiag._opt_in import PRECISION_TARGETS, plan_opt_in, resolve_targets

TARGETS = list(PRECISION_TARGETS.items())


def edge_values(target: torch.dtype, dtype: torch.dtype) -> list[float]:
    """Values of ``dtype`` on both sides of ``target``'s thresholds (one ulp of ``dtype`` apart), with signs."""
    info = torch.finfo(target)
    t = torch.tensor([info.tiny, info.max / 2], dtype=dtype)
    below = torch.nextafter(t, torch.zeros_like(t))
    above = torch.nextafter(t, torch.full_like(t, math.inf))
    tiny, half = t.tolist()
    tiny_below, half_below = below.tolist()
    tiny_above, half_above = above.tolist()
    values = [tiny, tiny_below, -tiny_below, tiny_above, half, -half, half_below, half_above]
    values += [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan]
    if float(info.max) < float(torch.finfo(dtype).max):
        values += [float(info.max), -float(info.max) * 4]
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(("name", "target"), TARGETS, ids=[n for n, _ in TARGETS])
def test_counts_on_both_sides_of_each_threshold(name, target, dtype):
    values = edge_values(target, dtype)
    x = torch.tensor(values, dtype=dtype)
    expected = precision_counts(x.tolist(), target)
    # Written out by hand, to guard the reference: tiny_below twice below; half, -half, half_above, inf, -inf
    # (and the two beyond max where they exist) at risk.
    beyond = 2 if float(torch.finfo(target).max) < float(torch.finfo(dtype).max) else 0
    assert expected == (len(values) - 3, 2, 5 + beyond)
    assert PR.precision_counts(x, [target]).tolist() == [float(c) for c in expected]


def test_counts_for_several_targets_at_once_follow_target_order():
    x = torch.tensor([2.0**-7, 2.0**-15, 300.0, 40000.0, 1.0])
    counts = PR.precision_counts(x, [torch.float16, torch.float8_e4m3fn, torch.bfloat16]).tolist()
    # fp16: 2**-15 < 2**-14 underflows, 40000 >= 32752; e4m3fn: 2**-7 and 2**-15 < 2**-6, 300 and 40000 >= 224.
    assert counts == [5.0, 1.0, 1.0, 2.0, 2.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("dtype", "target", "values", "expected"),
    [
        # fp16 subnormals are below fp16's smallest normal; 65504 and Inf are at risk, 32736 is not.
        (torch.float16, torch.float16, [2.0**-15, 2.0**-24, 2.0**-14, 32736.0, 32752.0, 65504.0, math.inf], (7, 2, 3)),
        (torch.float16, torch.float8_e4m3fn, [2.0**-7, 2.0**-6, 223.875, 224.0, -0.0], (4, 1, 1)),
        (torch.bfloat16, torch.bfloat16, [2.0**-127, 2.0**-126, 1.0, 2.0**127, -(2.0**127)], (5, 1, 2)),
        (torch.bfloat16, torch.float8_e5m2, [2.0**-15, 2.0**-14, 28672.0, 28800.0], (4, 1, 2)),
    ],
    ids=["fp16-fp16", "fp16-e4m3", "bf16-bf16", "bf16-e5m2"],
)
def test_low_precision_inputs_are_widened_exactly(dtype, target, values, expected):
    x = torch.tensor(values, dtype=dtype)
    assert x.tolist() == values  # every value is representable, so the case is what it says
    assert PR.precision_counts(x, [target]).tolist() == [float(c) for c in expected]
    assert precision_counts(values, target) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_counts_match_float_comparisons_on_values_spanning_every_range(dtype):
    g = torch.Generator().manual_seed(3)
    exponents = torch.empty(20_000, dtype=torch.float64).uniform_(-150, 130, generator=g)
    signs = torch.randint(0, 2, (20_000,), generator=g) * 2 - 1
    x = (signs * torch.exp2(exponents)).to(dtype)
    x[::97] = 0.0
    x[::101] = math.nan
    targets = [t for _, t in TARGETS]
    got = PR.precision_counts(x, targets).tolist()
    expected = [float(precision_counts(x.tolist(), targets[0])[0])]
    for target in targets:
        _, under, over = precision_counts(x.tolist(), target)
        expected += [float(under), float(over)]
    assert got == expected
    assert 0 < expected[1] < expected[0]
    assert 0 < expected[2] < expected[0]


def test_counts_pool_exactly_and_fractions_are_of_non_zero_elements():
    a = torch.tensor([0.0, 1e-6, 1.0, 50000.0])
    b = torch.tensor([1e-7, 2.0, 0.0, float("nan")])
    pooled = PR.precision_counts(a, [torch.float16]) + PR.precision_counts(b, [torch.float16])
    assert torch.equal(pooled, PR.precision_counts(torch.cat([a, b]), [torch.float16]))
    out = PR.finalize_precision(torch.stack([pooled, torch.zeros(3, dtype=torch.float64)]), ["float16"], "act")
    assert out["act_underflow_frac_float16"][0].item() == 2 / 5
    assert out["act_overflow_frac_float16"][0].item() == 1 / 5
    assert math.isnan(out["act_overflow_frac_float16"][1].item())  # a layer without non-zero values


def test_resolve_targets_accepts_names_and_dtypes_in_a_fixed_order():
    assert resolve_targets(None) is None
    assert resolve_targets(torch.bfloat16) == ("bfloat16",)
    assert resolve_targets(["float8_e5m2", "float16", torch.float16]) == ("float16", "float8_e5m2")


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("fp8", r"precision_targets: unknown target\(s\) \['fp8'\]; expected names from \['float16', 'bfloat16'"),
        ([torch.float32], r"unknown target\(s\) \['torch.float32'\]"),
        ([], r"precision_targets: expected at least one target from \['float16'"),
    ],
)
def test_resolve_targets_rejects_bad_targets(bad, match):
    with pytest.raises(ValueError, match=match):
        resolve_targets(bad)


@pytest.mark.parametrize(
    ("precision", "expected"),
    [("16-mixed", ("float16",)), ("bf16-mixed", ("bfloat16",)), ("bf16-true", ("bfloat16",)), ("32-true", ())],
)
def test_default_target_follows_the_trainer_precision(precision, expected):
    assert plan_opt_in(["act_overflow_frac"], None, precision).act_targets == expected


def test_plan_without_a_target_explains_how_to_get_one():
    plan = plan_opt_in(["act_overflow_frac", "act_grad_underflow_frac"], None, "32-true")
    assert plan.act_targets == plan.grad_targets == ()
    assert plan.logged == ()
    assert "32-true" in plan.note
    assert "precision_targets=" in plan.note
    plan = plan_opt_in(["act_grad_underflow_frac"], ("float16", "bfloat16"), "32-true")
    assert plan.note == ""
    assert plan.act_targets == ()
    assert plan.grad_targets == ("float16", "bfloat16")
    assert plan.logged == ("act_grad_underflow_frac_float16", "act_grad_underflow_frac_bfloat16")
