"""Rule ``replica_divergence`` on hand-made values: the largest and smallest norm of each replicated parameter.

Real 2-process DDP runs (one rank perturbing a weight, and the twin that does not) are in ``test_callback_ddp.py``;
the reduction that yields ``param_norm_min`` is in ``test_aggregation_sync.py``.
"""

from __future__ import annotations

import math

import pytest
from helpers import run_rules

from lightning_hookdiag.rules import RuleConfig

LAYERS = ["net.stem", "net.act", "net.head"]
CONFIG = RuleConfig(enabled=["replica_divergence"])


def run(high: dict[str, float], low: dict[str, float], config: RuleConfig = CONFIG) -> list:
    values = {"param_norm": high, "param_norm_min": low}
    return run_rules(values, LAYERS, list(reversed(LAYERS)), step=6, config=config)


def test_replicas_that_differ_are_named_by_owning_module_in_forward_order():
    high = {"net.head.weight": 2.0, "net.stem.weight": 4.0, "net.stem.bias": 1.0}
    low = {"net.head.weight": 1.5, "net.stem.weight": 3.0, "net.stem.bias": 1.0}
    stem, head = run(high, low)
    assert (stem.rule, stem.layer, stem.step, stem.stat, stem.phase) == (
        "replica_divergence",
        "net.stem",
        6,
        "param_norm",
        "forward",
    )
    assert (stem.value, stem.threshold) == (0.25, 1e-6)  # (4 - 3) / 4; the bias agrees and is not listed
    for fact in ("net.stem", "step 6", "net.stem.weight 3 to 4", "0.25", "replica_rtol=1e-06"):
        assert fact in stem.message, fact
    assert (head.layer, head.value) == ("net.head", 0.25)


def test_one_finding_per_module_lists_every_differing_parameter_with_the_largest_spread():
    high = {"net.head.weight": 2.0, "net.head.bias": 1.0}
    (finding,) = run(high, {"net.head.weight": 1.9, "net.head.bias": 0.5})
    assert finding.value == 0.5
    assert "2 replicated parameters have different norms" in finding.message
    assert "net.head.weight 1.9 to 2, net.head.bias 0.5 to 1" in finding.message


@pytest.mark.parametrize("high", [1.0, 4.0])
@pytest.mark.parametrize(("gap", "fires"), [(0.0, False), (2.0**-20, False), (2.0**-19, True)])
def test_the_tolerance_is_relative_to_the_largest_norm_and_exclusive(high, gap, fires):
    # Powers of two keep every difference exact, so the comparison at the tolerance itself is exact too.
    config = RuleConfig(enabled=["replica_divergence"], replica_rtol=2.0**-20)
    assert len(run({"net.head.weight": high}, {"net.head.weight": high * (1 - gap)}, config)) == int(fires)


def test_the_default_tolerance_fires_above_one_part_per_million():
    assert run({"net.head.weight": 1.0}, {"net.head.weight": 1.0 - 5e-7}) == []
    assert len(run({"net.head.weight": 1.0}, {"net.head.weight": 1.0 - 2e-6})) == 1


def test_tolerance_zero_fires_on_any_difference_and_a_looser_one_does_not():
    high, low = {"net.head.weight": 1.0}, {"net.head.weight": 1.0 - 2**-40}
    assert len(run(high, low, RuleConfig(enabled=["replica_divergence"], replica_rtol=0.0))) == 1
    assert run({"net.head.weight": 1.0}, {"net.head.weight": 0.9}, RuleConfig(replica_rtol=0.2)) == []


@pytest.mark.parametrize("low", [math.inf, math.nan])
def test_parameters_not_measured_or_not_finite_are_skipped(low):
    # inf: no process measured it; a NaN is nonfinite's business.
    assert run({"net.head.weight": 1.0}, {"net.head.weight": low}) == []
    assert run({"net.head.weight": math.nan}, {"net.head.weight": 1.0}) == []


def test_silent_without_the_smallest_norm():
    # One process, sharded parameters, or values read back from a logger: nothing to compare.
    assert run_rules({"param_norm": {"net.head.weight": 1.0}}, LAYERS, [], step=0) == []
    assert run({"net.head.weight": 1.0}, {"net.head.weight": 0.5}, RuleConfig(enabled=["nonfinite"])) == []


def test_one_process_has_no_smallest_norm_to_compare():
    import torch

    from lightning_hookdiag._aggregation import LayerStatsAggregator

    agg = LayerStatsAggregator(0, n_params=2)
    agg.update(params=(torch.arange(2), torch.ones(2, 4, dtype=torch.float64), slice(None)))
    assert "param_norm_min" not in agg.compute()  # no sync: nothing to compare with
