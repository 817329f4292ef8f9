import json
import math
import pickle
import re

import pytest
import torch
from helpers import TinyModule, make_trainer, run_rules

from lightning_hookdiag import LayerHealthCallback
from lightning_hookdiag.rules import (
    BUILTIN_RULES,
    RULES,
    AlertState,
    Baseline,
    Finding,
    RuleConfig,
    format_error,
    moved_mass_bound,
    values_from_metrics,
)
from lightning_hookdiag.rules._registry import Found, rule

BUILT_IN = {r.name: r for r in BUILTIN_RULES}

# Six layers whose forward order is neither alphabetical nor reverse-alphabetical, so that any accidental sorting
# by name picks the wrong layer.
FORWARD = ["net.stem", "net.act0", "net.mix", "net.body", "net.act1", "net.head"]
BACKWARD = list(reversed(FORWARD))
TYPES = {
    "net.stem": "Linear",
    "net.act0": "Tanh",
    "net.mix": "Linear",
    "net.body": "Linear",
    "net.act1": "ReLU",
    "net.head": "Linear",
}
PARAMS = ["net.stem.weight", "net.stem.bias", "net.mix.weight", "net.body.weight", "net.head.weight"]


def healthy_values() -> dict[str, dict[str, float]]:
    """A plausible step of a healthy network with every statistic present."""
    return {
        "act_mean": {n: 0.01 * i for i, n in enumerate(FORWARD)},
        "act_std": dict.fromkeys(FORWARD, 0.6),
        "act_absmax": dict.fromkeys(FORWARD, 2.5),
        "act_zero_frac": {n: 0.5 if n == "net.act1" else 0.0 for n in FORWARD},
        "act_nonfinite": dict.fromkeys(FORWARD, 0.0),
        "act_dead_frac": {"net.act1": 0.02},
        # Within an order of magnitude of the output end, both ways.
        "act_grad_norm": dict(zip(BACKWARD, [0.3, 0.5, 0.2, 0.9, 0.12, 0.05], strict=True)),
        "act_grad_nonfinite": dict.fromkeys(FORWARD, 0.0),
        "param_norm": dict.fromkeys(PARAMS, 3.0),
        "param_grad_norm": dict.fromkeys(PARAMS, 0.1),
        "param_update_ratio": dict.fromkeys(PARAMS, 0.001),
    }


def finding(rule: str, layer: str, step: int = 0) -> Finding:
    return Finding(rule, layer, step, 1.0, 0.5, f"{rule}: {layer}", "forward", "act_dead_frac")


# ------------------------------------------------------------------------------------------------- healthy


def assert_says(message: str, *facts: str) -> None:
    """The message states every one of ``facts`` (its key facts, not its whole wording)."""
    missing = [fact for fact in facts if fact not in message]
    assert not missing, f"{message!r} lacks {missing}"


def test_healthy_network_has_no_findings():
    assert run_rules(healthy_values(), FORWARD, BACKWARD, step=10, layer_types=TYPES) == []


def test_default_config_enables_every_rule():
    assert RuleConfig().enabled is None  # every rule of the callback
    assert [r.name for r in RuleConfig().select(BUILTIN_RULES)] == list(RULES)


# ----------------------------------------------------------------------------------------------- nonfinite


def test_nan_born_at_layer_3_is_reported_once_at_its_origin():
    values = healthy_values()
    # NaN appears in the third layer and propagates to every layer after it.
    values["act_nonfinite"] = {"net.stem": 0.0, "net.act0": 0.0, "net.mix": 12.0, "net.body": 64.0}
    values["act_nonfinite"] |= {"net.act1": 64.0, "net.head": 10.0}
    findings = run_rules(values, FORWARD, BACKWARD, step=4)
    assert [(f.rule, f.layer, f.phase, f.stat) for f in findings] == [
        ("nonfinite", "net.mix", "forward", "act_nonfinite")
    ]
    (f,) = findings
    assert f.value == 12.0
    assert f.threshold == 0.0
    assert f.step == 4
    assert "net.mix" in f.message
    assert "nonfinite" in f.message
    assert "3 more layers" in f.message
    assert "net.body, net.act1, net.head" in f.message


def test_nonfinite_origin_does_not_depend_on_dict_order():
    values = {"act_nonfinite": {"net.head": 1.0, "net.act1": 1.0, "net.body": 1.0}}
    (f,) = run_rules(values, FORWARD, BACKWARD, step=0)
    assert f.layer == "net.body"
    assert "2 more layers" in f.message


def test_single_nonfinite_layer_message_has_no_downstream_count():
    (f,) = run_rules({"act_nonfinite": {"net.act0": 2.0}}, FORWARD, BACKWARD, step=0)
    assert f.layer == "net.act0"
    assert "more layer" not in f.message


def test_gradient_nan_origin_is_first_in_backward_order():
    # A backward order that is not the reversed forward order (e.g. a residual branch finishes first).
    backward = ["net.head", "net.body", "net.act1", "net.mix", "net.act0", "net.stem"]
    values = {
        "act_grad_nonfinite": {"net.stem": 50.0, "net.act0": 50.0, "net.mix": 50.0, "net.act1": 7.0, "net.head": 0.0},
        # Norms over the finite part of NaN-ridden gradients: must not read as a vanishing gradient.
        "act_grad_norm": {"net.head": 1.0, "net.body": 0.8, "net.act1": 1e-9, "net.mix": 0.0, "net.stem": 0.0},
    }
    findings = run_rules(values, FORWARD, backward, step=2)
    assert [(f.rule, f.layer, f.phase, f.stat) for f in findings] == [
        ("nonfinite", "net.act1", "backward", "act_grad_nonfinite")
    ]
    assert findings[0].value == 7.0
    assert "3 more layers" in findings[0].message


def test_parameter_gradient_inf_names_the_layer_first_in_backward_order():
    values = healthy_values()
    values["param_grad_norm"] |= {"net.stem.weight": math.inf, "net.body.weight": math.nan}
    findings = run_rules(values, FORWARD, BACKWARD, step=9)
    assert [(f.rule, f.layer, f.phase, f.stat) for f in findings] == [
        ("nonfinite", "net.body", "backward", "param_grad_norm")
    ]
    (f,) = findings
    assert f.value == 1.0  # one non-finite parameter gradient in net.body
    assert "net.body.weight=nan" in f.message
    assert "1 more layer is also affected: net.stem" in f.message


def test_parameter_gradient_counts_every_nonfinite_parameter_of_the_origin():
    values = {"param_grad_norm": {"net.stem.weight": math.inf, "net.stem.bias": -math.inf, "net.head.weight": 1.0}}
    (f,) = run_rules(values, FORWARD, BACKWARD, step=0)
    assert (f.layer, f.value) == ("net.stem", 2.0)


def test_parameter_of_a_selected_container_maps_to_the_container():
    values = {"param_grad_norm": {"encoder.0.weight": math.nan}}
    (f,) = run_rules(values, ["encoder", "decoder"], ["decoder", "encoder"], step=0)
    assert f.layer == "encoder"


def test_parameter_maps_to_the_deepest_known_layer():
    values = {"param_grad_norm": {"encoder.0.weight": math.nan}}
    (f,) = run_rules(values, ["encoder", "encoder.0", "decoder"], [], step=0)
    assert f.layer == "encoder.0"


def test_parameter_of_an_unknown_layer_maps_to_its_dotted_parent():
    (f,) = run_rules({"param_grad_norm": {"a.b.weight": math.nan}}, [], [], step=0)
    assert f.layer == "a.b"


def test_backward_origin_falls_back_to_reversed_forward_order():
    values = {"param_grad_norm": {"net.stem.weight": math.nan, "net.body.weight": math.nan}}
    (f,) = run_rules(values, FORWARD, [], step=0)
    assert f.layer == "net.body"


def test_one_nonfinite_finding_per_origin_kind():
    values = {
        "act_nonfinite": {"net.body": 1.0, "net.head": 1.0},
        "act_grad_nonfinite": {"net.head": 1.0, "net.body": 1.0},
        "param_grad_norm": {"net.head.weight": math.nan, "net.body.weight": math.nan},
    }
    findings = run_rules(values, FORWARD, BACKWARD, step=0)
    assert [(f.layer, f.stat) for f in findings] == [
        ("net.body", "act_nonfinite"),
        ("net.head", "act_grad_nonfinite"),
        ("net.head", "param_grad_norm"),
    ]


# ---------------------------------------------------------------------------------------------- dead units


@pytest.mark.parametrize(
    ("frac", "fires"), [(0.9, True), (1.0, True), (0.8999, False), (0.0, False), (math.nan, False)]
)
def test_dead_units_threshold_is_inclusive(frac, fires):
    findings = run_rules({"act_dead_frac": {"net.act1": frac}}, FORWARD, BACKWARD, step=3)
    assert [(f.rule, f.layer) for f in findings] == ([("dead_units", "net.act1")] if fires else [])


def test_dead_units_finding_carries_value_threshold_and_names():
    (f,) = run_rules({"act_dead_frac": {"net.act1": 0.95}}, FORWARD, BACKWARD, step=3)
    assert (f.value, f.threshold, f.phase, f.stat) == (0.95, 0.9, "forward", "act_dead_frac")
    assert f.message.startswith("dead_units: 95.0% of the units of net.act1")


def test_dead_units_threshold_is_configurable_and_one_finding_per_layer():
    values = {"act_dead_frac": {"net.act1": 0.6, "net.act0": 0.5, "net.body": 0.4}}
    findings = run_rules(values, FORWARD, BACKWARD, step=0, config=RuleConfig(dead_frac_threshold=0.5))
    assert [f.layer for f in findings] == ["net.act0", "net.act1"]
    assert {f.threshold for f in findings} == {0.5}


# ------------------------------------------------------------------------------------ vanishing / exploding


def test_vanishing_gradient_names_first_layer_from_which_no_layer_reaches_the_ratio():
    norms = {"net.head": 2.0, "net.act1": 1.0, "net.body": 1e-3, "net.mix": 1.9e-3, "net.act0": 1e-6}
    findings = run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=5)
    assert [(f.rule, f.layer) for f in findings] == [("vanishing_gradient", "net.body")]
    (f,) = findings
    # The largest ratio from net.body to the input end is net.mix's: 1.9e-3 / 2.0.
    assert f.value == pytest.approx(9.5e-4)
    assert f.threshold == 1e-3
    assert (f.phase, f.stat) == ("backward", "act_grad_norm")
    assert_says(
        f.message,
        "vanishing_gradient at step 5",
        "from net.body to the input end (3 layers)",
        "vanishing_ratio=0.001",
        "(net.head, 2)",
        "the largest is 0.00095 times, at net.mix",
    )


def test_a_small_gradient_that_the_input_side_still_exceeds_is_not_vanishing():
    # q/k projections at init, a zero-initialised residual branch: tiny or exactly 0 in the middle, while layers
    # closer to the input (the residual stream) still receive the signal.
    norms = {"net.head": 1.0, "net.act1": 2e-5, "net.body": 0.0, "net.mix": 1e-7, "net.act0": 0.5, "net.stem": 0.01}
    assert run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=0) == []


def test_vanishing_fires_where_the_input_side_loses_the_signal_for_good():
    norms = {"net.head": 1.0, "net.act1": 2e-5, "net.body": 0.3, "net.mix": 1e-7, "net.act0": 0.0, "net.stem": 9e-4}
    (f,) = run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=0)
    assert (f.rule, f.layer, f.value) == ("vanishing_gradient", "net.mix", pytest.approx(9e-4))
    assert "at net.stem" in f.message


def test_a_single_large_gradient_near_the_input_is_not_exploding():
    # E.g. a position embedding whose gradient is summed over the batch; q/k or an exact-zero branch keep the
    # minimum low.
    norms = {"net.head": 1.0, "net.act1": 5e3, "net.body": 1.0, "net.mix": 2e4, "net.act0": 0.0, "net.stem": 3.0}
    assert run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=0) == []


def test_exploding_ignores_exact_zeros_on_the_input_side():
    norms = {"net.head": 1.0, "net.act1": 1.0, "net.body": 2e3, "net.mix": 0.0, "net.act0": 3e3, "net.stem": 5e3}
    (f,) = run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=0)
    # It fires from net.body on; the gradient grows in net.act1's backward: net.body's is 2e3 times net.act1's.
    assert (f.rule, f.layer, f.value) == ("exploding_gradient", "net.act1", pytest.approx(2e3))
    # Gains are measured up to net.body, where the rule fires: the only other one is 1 (head -> act1), and
    # act1 -> body holds all of the growth up to there.
    assert f"{math.log(2e3) / math.log(2e3):.0%}" == "100%"
    assert_says(
        f.message,
        "exploding_gradient at step 0",
        "from net.body to the input end (4 layers)",
        "exploding_ratio=1000",
        "(net.head, 1)",
        "the smallest is 2e+03 times, at net.body",
        "grows most in the backward of net.act1",
        "is 2e+03 times net.act1's",
        "100% of the orders of magnitude",
        "the other gains between consecutive layers is 1",
    )


def test_exploding_gradient_fires_at_the_first_crossing_layer_and_names_the_largest_gain():
    norms = {"net.head": 0.01, "net.act1": 0.02, "net.body": 5.0, "net.mix": 20.0, "net.stem": 400.0}
    findings = run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=5)
    # It fires from net.mix on (2000x the output end); the gains are 2, 250, 4 and 20: net.act1's backward, 250x.
    assert [(f.rule, f.layer) for f in findings] == [("exploding_gradient", "net.act1")]
    assert findings[0].value == pytest.approx(2000.0)
    assert findings[0].threshold == 1000.0
    assert "every layer from net.mix to the input end (2 layers)" in findings[0].message
    assert "net.body's output gradient, the next observed one in backward order, is 250 times net.act1's" in (
        findings[0].message
    )
    # Only the growth up to net.mix (2000x) made it fire: net.act1's 250x holds most of it; the others are 2 and 4.
    share = f"{math.log(250) / math.log(2e3):.0%}"
    assert findings[0].message.endswith(f"{share} of the orders of magnitude gained from the output end; the median"
                                        " of the other gains between consecutive layers is 3")  # fmt: skip


def test_exploding_gradient_through_one_module_names_it_not_the_layer_that_receives_the_growth():
    # The ReLU RNN: embed -> rnn -> head; the gradient grows 2.5e4x through time inside the RNN.
    forward, backward = ["model.embed", "model.rnn", "model.head"], ["model.head", "model.rnn", "model.embed"]
    norms = {"model.head": 0.3, "model.rnn": 0.15, "model.embed": 0.15 * 2.5e4}
    (f,) = run_rules({"act_grad_norm": norms}, forward, backward, step=0)
    assert (f.rule, f.layer, f.value) == ("exploding_gradient", "model.rnn", pytest.approx(1.25e4))
    assert "from model.embed to the input end (1 layer)" in f.message
    assert "model.embed's output gradient, the next observed one in backward order, is 2.5e+04 times" in f.message
    assert f.message.endswith("100% of the orders of magnitude gained from the output end; the median of the other"
                              " gains between consecutive layers is 0.5")  # fmt: skip


def test_exploding_gradient_spread_over_a_chain_says_how_little_one_layer_holds():
    names = [f"net.{i}" for i in range(8)]
    norms = {name: 3.0**i * (1.25 if i == 5 else 1.0) for i, name in enumerate(names)}  # x3 per layer, x3.75 once
    (f,) = run_rules({"act_grad_norm": norms}, names[::-1], names, step=0)
    # net.5's norm over net.4's is the largest gain, but it holds a fifth of the growth: no layer is the amplifier,
    # and the input end of the side, where the growth starts, is named (here also the first layer past the threshold).
    assert f.layer == "net.7"
    assert "The growth is spread over the layers up to net.7, none holding most of it" in f.message
    assert f"is {3.75:.3g} times net.4's" in f.message
    total = norms["net.7"] / norms["net.0"]
    assert (f"{math.log(3.75) / math.log(total):.0%} of the orders of magnitude gained from the output end; the"
            " median of the other gains between consecutive layers is 3)") in f.message  # fmt: skip
    assert f.message.endswith("the growth starts at its input end, net.7, not where the threshold is first crossed")


def test_exploding_gradient_spread_over_a_stack_names_the_input_end_not_where_the_threshold_is_crossed():
    # Every layer multiplies the gradient by 3 on its way to the input: 3**7 = 2187 crosses exploding_ratio=1000 at
    # net.1 (in forward order), and the growth starts at net.0, the input end, which is named (issue 38, principle 5).
    names = [f"net.{i}" for i in range(9)]
    norms = {name: 3.0 ** (8 - i) for i, name in enumerate(names)}
    (f,) = run_rules({"act_grad_norm": norms}, names, names[::-1], step=0)
    assert (f.rule, f.layer) == ("exploding_gradient", "net.0")
    assert "every layer from net.1 to the input end (2 layers)" in f.message
    assert f.value == pytest.approx(3.0**7)  # the smallest ratio on the side, at net.1


def test_ratio_exactly_at_threshold_does_not_fire():
    norms = {"net.head": 1.0, "net.body": 1e-3, "net.stem": 1e3}
    assert run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=0) == []


def test_reference_is_first_finite_positive_norm_in_backward_order():
    # The output end has no usable norm (NaN, then 0): the reference moves to net.act1.
    norms = {"net.head": math.nan, "net.act1": 0.0, "net.body": 4.0, "net.mix": 3e-3}
    (f,) = run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=0)
    assert (f.rule, f.layer) == ("vanishing_gradient", "net.mix")
    assert f.value == pytest.approx(7.5e-4)


def test_layers_without_finite_norm_are_skipped():
    norms = {"net.head": 1.0, "net.act1": math.inf, "net.body": math.nan, "net.mix": 0.5}
    assert run_rules({"act_grad_norm": norms}, FORWARD, BACKWARD, step=0) == []


def test_zero_norm_below_a_reference_is_vanishing():
    (f,) = run_rules({"act_grad_norm": {"net.head": 1.0, "net.body": 0.0}}, FORWARD, BACKWARD, step=0)
    assert (f.rule, f.layer, f.value) == ("vanishing_gradient", "net.body", 0.0)


def test_gradient_ratios_configurable():
    config = RuleConfig(vanishing_ratio=0.1, exploding_ratio=10)
    low = {"net.head": 1.0, "net.body": 0.05, "net.stem": 0.08}
    high = {"net.head": 1.0, "net.body": 20.0, "net.stem": 30.0}
    assert run_rules({"act_grad_norm": low}, FORWARD, BACKWARD, step=0) == []  # defaults: quiet
    assert run_rules({"act_grad_norm": high}, FORWARD, BACKWARD, step=0) == []
    findings = [f for v in (low, high) for f in run_rules({"act_grad_norm": v}, FORWARD, BACKWARD, 0, config)]
    # Exploding fires from net.body on; the growth (20x, then 1.5x) is in the backward of net.head.
    assert [(f.rule, f.layer, f.threshold, f.value) for f in findings] == [
        ("vanishing_gradient", "net.body", 0.1, pytest.approx(0.08)),
        ("exploding_gradient", "net.head", 10.0, pytest.approx(20.0)),
    ]


# ------------------------------------------------------------------------------------------------ no_gradient
# net.stem .. net.body were cut off (a .detach() between net.body and net.act1); net.act1 and net.head got one.
CUT = {"act_grad_norm": {"net.head": 1.0, "net.act1": 0.5}}
CUT_BACKWARD = ["net.head", "net.act1"]


def test_no_gradient_names_the_first_cut_off_layer_and_counts_every_one():
    missing = ["net.body", "net.mix", "net.stem", "net.act0"]  # any order: the rule orders them
    (f,) = run_rules(CUT, FORWARD, CUT_BACKWARD, step=3, missing_grads=missing)
    assert (f.rule, f.layer, f.step, f.value, f.threshold) == ("no_gradient", "net.stem", 3, 4.0, 0.0)
    assert (f.phase, f.stat) == ("backward", "act_grad_norm")
    assert_says(
        f.message,
        "no_gradient at step 3: the output of net.stem",
        "while net.act1, later in forward order, did",
        "stops between net.body and net.act1",
        "3 more layers after it are also cut off: net.act0, net.mix, net.body",
    )


def test_no_gradient_is_silent_on_outputs_after_the_first_layer_that_got_a_gradient():
    # A pooler nothing reads, after layers that learn; or the last layers of a step that never ran backward.
    got = {"act_grad_norm": {"net.head": 1.0, "net.act1": 0.5, "net.body": 0.5, "net.mix": 0.3, "net.stem": 0.2}}
    backward = ["net.head", "net.act1", "net.body", "net.mix", "net.stem"]
    assert run_rules(got, FORWARD, backward, step=0, missing_grads=["net.act0"]) == []
    assert run_rules({}, FORWARD, [], step=0, missing_grads=FORWARD) == []
    assert run_rules(CUT, FORWARD, CUT_BACKWARD, step=0, missing_grads=[]) == []


def test_no_gradient_skips_a_layer_whose_parameters_learn():
    # An nn.LSTM whose head reads h_n: its watched first output got no gradient, its weights did.
    values = dict(CUT, param_grad_norm={"net.stem.weight": 0.2, "net.mix.weight": 0.0, "net.head.weight": 1.0})
    (f,) = run_rules(values, FORWARD, CUT_BACKWARD, step=0, missing_grads=["net.stem", "net.mix"])
    assert (f.layer, f.value) == ("net.mix", 1.0)  # an exact-zero gradient is no gradient
    assert f.message.endswith("so net.mix and what runs before the cut do not learn")


def test_no_gradient_can_be_disabled():
    config = RuleConfig(enabled=[r for r in RULES if r != "no_gradient"])
    assert run_rules(CUT, FORWARD, CUT_BACKWARD, step=0, config=config, missing_grads=["net.stem"]) == []


# -------------------------------------------------------------------------------------------------- eval_mode
def test_eval_mode_names_the_first_module_in_forward_order_and_lists_the_others():
    modes = {"net.head": "Dropout", "net.mix": "BatchNorm1d", "net.late": "BatchNorm1d"}  # net.late never ran
    (f,) = run_rules({}, FORWARD, BACKWARD, step=2, eval_mode=modes)
    assert (f.rule, f.layer, f.step, f.value, f.threshold) == ("eval_mode", "net.mix", 2, 3.0, 0.0)
    assert (f.phase, f.stat) == ("forward", "training")
    assert_says(
        f.message,
        "eval_mode at step 2: net.mix (BatchNorm1d) ran with training=False",
        "normalises with its running statistics",
        "Call .train() after it",
        "2 more modules are in eval mode too: net.head (Dropout), net.late (BatchNorm1d)",
    )
    (f,) = run_rules({}, FORWARD, BACKWARD, step=2, eval_mode={"net.head": "Dropout"})
    assert "it drops nothing, so the regularisation the model was built with is off." in f.message
    assert run_rules({}, FORWARD, BACKWARD, step=2, eval_mode={}) == []


def test_eval_mode_comes_before_the_rules_it_can_explain():
    values = {"act_dead_frac": {"net.act1": 1.0}}
    findings = run_rules(values, FORWARD, BACKWARD, step=0, eval_mode={"net.stem": "BatchNorm1d"})
    assert [(f.rule, f.layer) for f in findings] == [("eval_mode", "net.stem"), ("dead_units", "net.act1")]


# ---------------------------------------------------------------------------------------------- saturation


def test_saturated_tanh_is_found_with_its_guaranteed_share():
    values = {"act_mean": {"net.act0": 0.0}, "act_std": {"net.act0": 0.99}}
    (f,) = run_rules(values, FORWARD, BACKWARD, step=1, layer_types=TYPES)
    assert (f.rule, f.layer, f.phase) == ("saturation", "net.act0", "forward")
    # (0.99**2 - 0.9**2) / (1 - 0.9**2)
    assert f.value == pytest.approx((0.9801 - 0.81) / 0.19)
    assert f.threshold == 0.5
    assert "net.act0" in f.message
    assert "Tanh" in f.message


def test_saturated_sigmoid_near_zero_is_found():
    values = {"act_mean": {"gate": 0.02}, "act_std": {"gate": 0.05}}
    (f,) = run_rules(values, ["gate"], ["gate"], step=0, layer_types={"gate": "torch.nn.Sigmoid"})
    # z = 2y - 1: E[z^2] = 4 * 0.05^2 + (2 * 0.02 - 1)^2
    assert f.value == pytest.approx((4 * 0.0025 + 0.96**2 - 0.81) / 0.19)


def test_healthy_sigmoid_and_large_relu_are_not_saturated():
    values = {"act_mean": {"gate": 0.5, "relu": 50.0}, "act_std": {"gate": 0.2, "relu": 100.0}}
    types = {"gate": "Sigmoid", "relu": "ReLU"}
    assert run_rules(values, ["gate", "relu"], [], step=0, layer_types=types) == []


def test_saturation_needs_layer_types():
    values = {"act_mean": {"net.act0": 0.0}, "act_std": {"net.act0": 1.0}}
    assert run_rules(values, FORWARD, BACKWARD, step=0) == []


def test_saturation_bound_threshold_is_inclusive_and_configurable():
    # Bound (m2 - 0.81) / 0.19 equals exactly 0.5 at m2 = 0.905: use a frac just below/above it.
    values = {"act_mean": {"t": 0.0}, "act_std": {"t": math.sqrt(0.905)}}
    low = RuleConfig(saturation_frac=0.49)
    high = RuleConfig(saturation_frac=0.51)
    assert len(run_rules(values, ["t"], [], step=0, config=low, layer_types={"t": "Tanh"})) == 1
    assert run_rules(values, ["t"], [], step=0, config=high, layer_types={"t": "Tanh"}) == []


def test_huge_finite_statistics_bound_the_rules_instead_of_raising():
    # A Python float squared beyond ~1e154 raises OverflowError (1e200 * 1e200 is inf): the rules must not.
    values = {"act_mean": {"t": 1e200, "s": 1e200}, "act_std": {"t": 1.0, "s": 1.0}}
    found = run_rules(values, ["t", "s"], [], step=0, layer_types={"t": "Tanh", "s": "Sigmoid"})
    assert [(f.layer, f.value) for f in found if f.rule == "saturation"] == [("t", 1.0), ("s", 1.0)]
    assert moved_mass_bound(1e300, 2**-23) == 1.0


# ------------------------------------------------------------------------------------------ missing stats


def test_no_statistics_no_findings():
    assert run_rules({}, FORWARD, BACKWARD, step=0, layer_types=TYPES) == []


@pytest.mark.parametrize(
    "values",
    [
        {"act_mean": {"net.act0": 0.0}},  # saturation without act_std
        {"act_std": {"net.act0": 1.0}},  # saturation without act_mean
        {"act_grad_norm": {"net.head": 1.0}},  # nothing to compare with
        {"act_grad_norm": {"net.head": 0.0, "net.body": 0.0}},  # no positive reference
        {"param_update_ratio": {"net.head.weight": math.inf}},
        {"act_dead_frac": {}, "act_nonfinite": {}},
    ],
)
def test_partial_statistics_do_not_crash_or_fire(values):
    assert run_rules(values, FORWARD, BACKWARD, step=0, layer_types=TYPES) == []


def test_layers_missing_from_the_orders_are_handled():
    values = {"act_nonfinite": {"ghost": 1.0}, "act_grad_norm": {"ghost": 1.0, "phantom": 1e-9}}
    findings = run_rules(values, [], [], step=0)
    assert [(f.rule, f.layer) for f in findings] == [("nonfinite", "ghost"), ("vanishing_gradient", "phantom")]


def test_disabled_rules_do_not_run():
    values = {"act_nonfinite": {"net.mix": 1.0}, "act_dead_frac": {"net.act1": 1.0}}
    findings = run_rules(values, FORWARD, BACKWARD, step=0, config=RuleConfig(enabled=["dead_units"]))
    assert [f.rule for f in findings] == ["dead_units"]
    assert run_rules(values, FORWARD, BACKWARD, step=0, config=RuleConfig(enabled=())) == []


# ------------------------------------------------------------------------------------------------ ordering


def test_mixed_findings_forward_first_in_forward_order_then_backward_in_backward_order():
    values = {
        "act_nonfinite": {"net.act1": 3.0, "net.head": 3.0},
        "act_dead_frac": {"net.act1": 1.0},
        "act_mean": {"net.act0": 0.0},
        "act_std": {"net.act0": 1.0},
        "act_grad_norm": {"net.head": 1.0, "net.act1": 2e3, "net.body": 1.0, "net.mix": 1e-5},
        "param_grad_norm": {"net.stem.weight": math.inf},
    }
    findings = run_rules(values, FORWARD, BACKWARD, step=0, layer_types=TYPES)
    assert [(f.rule, f.layer) for f in findings] == [
        ("saturation", "net.act0"),  # forward, depth 1
        ("nonfinite", "net.act1"),  # forward, depth 4; same layer: RULES order
        ("dead_units", "net.act1"),
        ("vanishing_gradient", "net.mix"),  # backward, position 3
        ("nonfinite", "net.stem"),  # backward, position 5
    ]


# ------------------------------------------------------------------------------------------------- messages


def test_format_error_names_origin_first_and_lists_the_rest():
    values = {"act_nonfinite": {"net.body": 1.0}, "act_dead_frac": {"net.act1": 1.0}}
    findings = run_rules(values, FORWARD, BACKWARD, step=8)
    text = format_error(findings)
    first, *rest = text.splitlines()
    assert first.startswith("layer health check failed at step 8 in net.body (rule nonfinite)")
    assert rest[0] == "1 more finding:"
    assert rest[1] == f"  - {findings[1].message}"
    assert len(rest) == 2


def test_format_error_with_a_single_finding_has_no_list():
    (f,) = run_rules({"act_dead_frac": {"net.act1": 1.0}}, FORWARD, BACKWARD, step=0)
    assert format_error([f]).splitlines() == [
        f"layer health check failed at step 0 in net.act1 (rule dead_units): {f.message}"
    ]


def test_format_error_rejects_no_findings():
    with pytest.raises(ValueError, match="at least one finding"):
        format_error([])


def test_finding_str_is_its_message():
    assert str(finding("dead_units", "x")) == "dead_units: x"


# ---------------------------------------------------------------------------------------------- AlertState


def test_alert_state_warns_once_until_cleared_then_again():
    state = AlertState()
    a, b = finding("dead_units", "net.act1"), finding("saturation", "net.act0")
    assert state.update([a]) == [a]
    assert state.update([a, b]) == [b]  # a still active; b new
    assert state.update([a, b]) == []
    assert state.update([b]) == []  # a clears here
    assert state.state_dict()["active"] == [["saturation", "net.act0"]]
    assert state.active == {("saturation", "net.act0")}
    assert state.update([a, b]) == [a]  # a re-alerts; b still active
    assert state.update([]) == []  # both clear
    assert state.active == frozenset()
    assert state.update([b]) == [b]


def test_alert_state_keys_on_rule_and_layer():
    state = AlertState()
    state.update([finding("dead_units", "x")])
    other_rule, other_layer = finding("saturation", "x"), finding("dead_units", "y")
    assert state.update([finding("dead_units", "x"), other_rule, other_layer]) == [other_rule, other_layer]


def test_alert_state_counts_every_finding_seen():
    state = AlertState()
    state.update([finding("dead_units", "x"), finding("dead_units", "y")])
    state.update([finding("dead_units", "x")])
    assert state.counts == {"nonfinite": 0, "loss_spike": 0, "eval_mode": 0, "dead_units": 3, "no_gradient": 0,
                            "vanishing_gradient": 0, "exploding_gradient": 0, "saturation": 0,
                            "precision_headroom": 0, "update_ratio": 0, "warmup_stuck": 0, "stale_gradients": 0,
                            "zeroed_gradients": 0, "input_scale": 0, "not_updated": 0, "replica_divergence": 0,
                            "attention_logits": 0, "logit_drift": 0, "unbounded_loss": 0, "loss_below_floor": 0,
                            "squashed_twice": 0, "wrong_softmax_dim": 0, "update_jump": 0, "repeated_batch": 0,
                            "unregistered_module": 0,
                            "shared_parameters": 0, "scheduler_overstepped": 0, "stopped_running": 0,
                            "output_unused": 0, "idle_optimizer": 0, "shadowed_method": 0}  # fmt: skip


def test_alert_state_round_trips_through_json_and_pickle():
    state = AlertState()
    state.update([finding("dead_units", "x"), finding("nonfinite", "y")])
    state.update([finding("dead_units", "x"), finding("nonfinite", "y")])
    saved = state.state_dict()
    assert saved["active"] == [["dead_units", "x"], ["nonfinite", "y"]]
    assert json.loads(json.dumps(saved)) == saved

    restored = AlertState()
    restored.load_state_dict(json.loads(json.dumps(saved)))
    assert restored.state_dict() == saved
    assert restored.update([finding("dead_units", "x")]) == []  # still active after the restore

    unpickled = pickle.loads(pickle.dumps(state))
    assert unpickled.state_dict() == saved
    assert unpickled.update([finding("nonfinite", "y")]) == []
    assert unpickled.counts["nonfinite"] == 3


def test_alert_state_loads_an_empty_state():
    state = AlertState()
    state.update([finding("dead_units", "x")])
    state.load_state_dict({})
    assert state.state_dict()["active"] == []
    assert state.counts["dead_units"] == 0


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"active": [["dead_units"]]}, r"'active' expects \[rule, layer\] pairs, got \['dead_units'\]"),
        ({"active": [["dead_units", 3]]}, "'active' expects"),
        ({"counts": {"dead_units": -1}}, r"'counts' expects .*-1"),
        ({"counts": {"dead_units": True}}, "'counts' expects"),
        ({"counts": [1]}, "'counts' expects"),
    ],
)
def test_alert_state_rejects_malformed_state(bad, match):
    with pytest.raises(ValueError, match=match):
        AlertState().load_state_dict(bad)


# ---------------------------------------------------------------------------------------------- RuleConfig


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("dead_frac_threshold", 0.0, "a number in (0, 1]"),
        ("dead_frac_threshold", 1.5, "a number in (0, 1]"),
        ("vanishing_ratio", 1.0, "a number in (0, 1)"),
        ("vanishing_ratio", -1e-3, "a number in (0, 1)"),
        ("exploding_ratio", 1.0, "a finite number > 1"),
        ("exploding_ratio", math.inf, "a finite number > 1"),
        ("saturation_level", 1.0, "a number in (0, 1)"),
        ("saturation_frac", 0.0, "a number in (0, 1]"),
        ("saturation_frac", math.nan, "a number in (0, 1]"),
        ("vanishing_ratio", True, "a number in (0, 1)"),
        ("exploding_ratio", "1e3", "a finite number > 1"),
        ("overflow_frac_threshold", 1.0, "a number in [0, 1)"),
        ("overflow_frac_threshold", -0.1, "a number in [0, 1)"),
        ("moved_mass_threshold", 0.0, "a number in (0, 1]"),
        ("moved_mass_threshold", 1.5, "a number in (0, 1]"),
        ("moved_mass_threshold", "0.1", "a number in (0, 1]"),
        ("replica_rtol", -1e-6, "a number in [0, 1)"),
        ("replica_rtol", 1.0, "a number in [0, 1)"),
        ("replica_rtol", math.nan, "a number in [0, 1)"),
        ("replica_rtol", False, "a number in [0, 1)"),
    ],
)
def test_rule_config_rejects_bad_numbers(field, value, valid):
    with pytest.raises(ValueError, match=f"^{re.escape(f'{field}: expected {valid}, got {value!r}')}$"):
        RuleConfig(**{field: value})


def test_an_unknown_rule_is_rejected_when_the_callback_is_built_listing_the_valid_ones():
    # A name that is no built-in rule may name an extension rule of the callback: the callback checks it.
    unknown = r"enabled: unknown rule\(s\) 'dead'; expected names from \['nonfinite'"
    with pytest.raises(ValueError, match=unknown):
        LayerHealthCallback(rules={"enabled": ["nonfinite", "dead"]})
    with pytest.raises(ValueError, match=unknown):
        LayerHealthCallback(rules=RuleConfig(enabled=["nonfinite", "dead"]))
    with pytest.raises(ValueError, match=unknown):
        run_rules({}, config=RuleConfig(enabled=["nonfinite", "dead"]))
    with pytest.raises(ValueError, match="enabled: expected None or rule names, got 3"):
        RuleConfig(enabled=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"enabled: expected rule names \(strings\)"):
        RuleConfig(enabled=["nonfinite", 3])  # type: ignore[list-item]


def test_rule_config_normalises_enabled_and_numbers():
    config = RuleConfig(enabled=["saturation", "nonfinite", "saturation"], exploding_ratio=100)
    assert config.enabled == ("nonfinite", "saturation")
    assert isinstance(config.exploding_ratio, float)
    assert RuleConfig(enabled="dead_units").enabled == ("dead_units",)
    assert RuleConfig(enabled=["dead_units"]) == RuleConfig(enabled=("dead_units",))


def test_rule_config_is_frozen():
    with pytest.raises(AttributeError):
        RuleConfig().vanishing_ratio = 0.5  # type: ignore[misc]


def test_from_mapping_builds_and_defaults():
    assert RuleConfig.from_mapping(None) == RuleConfig()
    assert RuleConfig.from_mapping({}) == RuleConfig()
    assert (RuleConfig().moved_mass_threshold, RuleConfig().replica_rtol) == (0.1, 1e-6)
    assert RuleConfig.from_mapping({"moved_mass_threshold": 1, "replica_rtol": 0}).replica_rtol == 0.0
    config = RuleConfig.from_mapping({"dead_frac_threshold": 0.5, "enabled": ["dead_units", "nonfinite"]})
    assert config == RuleConfig(dead_frac_threshold=0.5, enabled=("nonfinite", "dead_units"))


def test_from_mapping_rejects_unknown_keys_listing_valid_ones_sorted():
    valid = (
        "['attn_logit_threshold', 'attn_trend_floor', 'attn_trend_horizon', 'dead_frac_threshold',"
        " 'drift_loss_tolerance', 'effective_lr_low', 'enabled', 'exploding_ratio', 'input_scale_floor',"
        " 'input_scale_limit',"
        " 'logit_drift_nats', 'moved_mass_threshold', 'overflow_frac_threshold', 'replica_rtol',"
        " 'saturation_frac', 'saturation_level', 'spike_growth', 'trend_window', 'unbounded_growth',"
        " 'update_jump_ratio', 'update_ratio_low', 'vanishing_ratio']"  # the sentinel's spike_* moved: SentinelConfig
    )
    with pytest.raises(ValueError, match=r"unknown rule setting\(s\) \['vanish', 'zzz'\]; valid keys: ") as info:
        RuleConfig.from_mapping({"zzz": 1, "vanish": 0.1, "exploding_ratio": 10})
    assert str(info.value).endswith(valid)


def test_from_mapping_validates_values_and_type():
    with pytest.raises(ValueError, match=r"^exploding_ratio: expected a finite number > 1, got 0.5$"):
        RuleConfig.from_mapping({"exploding_ratio": 0.5})
    with pytest.raises(ValueError, match="expected a mapping"):
        RuleConfig.from_mapping([("exploding_ratio", 10)])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- helpers


def test_values_from_metrics_regroups_logged_keys():
    metrics = {
        "lh/act_grad_norm/net.head": 1.0,
        "lh/act_grad_norm/net.body": 1e-5,
        "lh/param_grad_norm/net.head.weight": math.inf,
        "lh/grad_norm_total": 3.0,
        "other/act_mean/x": 1.0,
    }
    values = values_from_metrics(metrics, prefix="lh")
    assert values == {
        "act_grad_norm": {"net.head": 1.0, "net.body": 1e-5},
        "param_grad_norm": {"net.head.weight": math.inf},
    }
    assert [f.rule for f in run_rules(values, FORWARD, BACKWARD, step=0)] == ["nonfinite", "vanishing_gradient"]


# ------------------------------------------------------------------------------------------ precision_headroom
ORDER = ["fc1", "fc2"]


def test_precision_headroom_fires_per_layer_and_target_forward_then_backward():
    values = {
        "act_overflow_frac_float16": {"fc1": 0.0, "fc2": 0.25},
        "act_overflow_frac_float8_e4m3fn": {"fc1": 0.5},
        "act_grad_overflow_frac_float16": {"fc1": 1e-3, "fc2": 0.0},
        "act_underflow_frac_float16": {"fc1": 0.9},  # underflow alone is not an overflow risk
    }
    findings = run_rules(values, ORDER, ORDER[::-1], step=4)
    got = [(f.rule, f.layer, f.stat, f.phase, f.value) for f in findings]
    assert got == [
        ("precision_headroom", "fc1", "act_overflow_frac_float8_e4m3fn", "forward", 0.5),
        ("precision_headroom", "fc2", "act_overflow_frac_float16", "forward", 0.25),
        ("precision_headroom", "fc1", "act_grad_overflow_frac_float16", "backward", 1e-3),
    ]
    assert_says(
        findings[0].message,
        "0.5 of the non-zero outputs of fc1 at step 4",
        "float8_e4m3fn",
        "overflow_frac_threshold=0",
    )
    assert "output gradients of fc1" in findings[2].message


def test_precision_headroom_threshold_is_exclusive_and_configurable():
    values = {"act_overflow_frac_bfloat16": {"fc1": 0.1, "fc2": 0.2}}
    config = RuleConfig(overflow_frac_threshold=0.1)
    assert [f.layer for f in run_rules(values, ORDER, ORDER[::-1], step=0, config=config)] == ["fc2"]
    config = RuleConfig(enabled=["nonfinite"])
    assert run_rules(values, ORDER, ORDER[::-1], step=0, config=config) == []


# ------------------------------------------------------------------------------------------------ the registry


@rule(order=99, phase="forward", stat="act_absmax", name="wide_output")
def wide_output(ctx):
    """A rule added the way a user adds one: one decorated function, passed to the callback that runs it."""
    for layer, value in ctx.stat("act_absmax").items():
        if value > 50.0:
            yield Found(layer, value, f"wide_output: |y| reached {value:.3g} in {layer} at step {ctx.step}", 50.0)


def test_a_rule_written_in_one_function_fires_on_a_real_fit_and_stays_silent_on_a_healthy_one():
    def fit(weight: float) -> tuple[LayerHealthCallback, LayerHealthCallback]:
        module = TinyModule()
        with torch.no_grad():
            module.model[0].weight.fill_(weight)
        # Two callbacks in one process, on one Trainer: only the one given the rule runs it.
        given = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", extensions=[wide_output])
        other = LayerHealthCallback(every_n_steps=1, on_anomaly="ignore", prefix="plain")
        make_trainer([given, other], max_steps=2).fit(module)
        return given, other

    (wide, beside), (healthy, _) = fit(100.0), fit(0.1)
    found = [f for f in wide.findings if f.rule == "wide_output"]
    assert {f.step for f in found} == {0}  # alerted once per layer while it persists
    first = found[0]  # in forward order, like every rule's findings
    assert (first.layer, first.phase, first.stat, first.threshold) == ("model.0", "forward", "act_absmax", 50.0)
    assert first.value > 50.0
    assert "in model.0 at step 0" in first.message
    assert wide.alert_counts["wide_output"] >= len(found)
    assert [f for f in healthy.findings if f.rule == "wide_output"] == []
    # The other callback of the same fit saw the same values and knows no such rule.
    assert "wide_output" not in beside.alert_counts
    assert [f for f in beside.findings if f.rule == "wide_output"] == []
    assert beside.last_metrics.keys() == {k.replace("layer_health", "plain", 1) for k in wide.last_metrics}
    # Nothing process-wide: a new configuration or callback does not know it.
    assert "wide_output" not in [r.name for r in RuleConfig().select(BUILTIN_RULES)]
    assert "wide_output" not in AlertState().counts
    with pytest.raises(ValueError, match="wide_output"):
        LayerHealthCallback(rules={"enabled": ["wide_output"]})


def test_an_extension_rule_named_in_enabled_is_valid_for_its_callback_only():
    callback = LayerHealthCallback(every_n_steps=1, rules={"enabled": ["wide_output"]}, extensions=[wide_output])
    assert callback.rule_config.enabled == ("wide_output",)
    with pytest.raises(ValueError, match="unknown rule") as info:
        LayerHealthCallback(rules={"enabled": ["wide_output", "dead_units"]})
    assert "'wide_output'" in str(info.value)
    assert "'dead_units'" in str(info.value).partition("expected names from")[2]  # the valid names are listed
    # An explicit list without it leaves it out, like any rule.
    module = TinyModule()
    with torch.no_grad():
        module.model[0].weight.fill_(100.0)
    quiet = LayerHealthCallback(
        every_n_steps=1, on_anomaly="ignore", rules={"enabled": RULES}, extensions=[wide_output]
    )
    make_trainer([quiet], max_steps=1).fit(module)
    assert quiet.alert_counts["wide_output"] == 0


def test_an_extension_rule_that_reads_the_optimizer_facts_gets_them_on_a_real_fit():
    # The only rule enabled, and not built in: the facts are still gathered for it.
    seen: list[dict] = []

    @rule(order=99, phase="backward", stat="param_update_ratio", name="reads_facts", reads=["param_facts"])
    def reads_facts(ctx):
        seen.append(dict(ctx.fact("param_facts")))
        return []

    callback = LayerHealthCallback(every_n_steps=1, rules={"enabled": ["reads_facts"]}, extensions=[reads_facts])
    make_trainer([callback], max_steps=2).fit(TinyModule())
    assert len(seen) == 2
    assert set(seen[0]) == {name for name, _ in TinyModule().named_parameters()}
    assert all(facts.held for facts in seen[1].values())  # every parameter is in the optimizer


def test_bad_extension_entries_are_named_when_the_callback_is_built():
    def flat_output(ctx):  # a rule function without its decorator
        return []

    with pytest.raises(ValueError, match=r"extensions\[1\]: expected a rule .* got <function") as info:
        LayerHealthCallback(extensions=[wide_output, flat_output])
    assert "flat_output" in str(info.value)
    with pytest.raises(ValueError, match="extensions: expected a sequence"):
        LayerHealthCallback(extensions="wide_output")
    with pytest.raises(ValueError, match=r"extensions\[0\]: rule name 'dead_units' is taken by a built-in rule"):
        LayerHealthCallback(
            extensions=[rule(order=0, phase="forward", stat="act_dead_frac", name="dead_units")(flat_output)]
        )
    with pytest.raises(ValueError, match=r"extensions\[1\]: rule name 'wide_output' is taken by extensions\[0\]"):
        LayerHealthCallback(extensions=[wide_output, wide_output])


def test_a_rule_says_nothing_without_the_context_it_reads():
    values = {"param_update_ratio": {"net.stem.weight": 1e-9}, "param_norm": {"net.stem.weight": 1.0}}
    # not_updated reads the optimizer facts: without them it is silent whatever the values say.
    assert BUILT_IN["not_updated"].reads == ("param_facts",)
    assert run_rules(values, FORWARD, BACKWARD, step=3, config=RuleConfig(enabled=["not_updated"])) == []
    assert [BUILT_IN[name].check.__module__ for name in ("nonfinite", "loss_spike", "update_jump")] == [
        "lightning_hookdiag.rules._nonfinite",
        "lightning_hookdiag.rules._spike",
        "lightning_hookdiag.rules._precursors",
    ]


def test_enabled_defaults_to_every_rule_of_the_callback():
    import dataclasses
    import inspect

    assert RuleConfig.enabled is None  # a plain default: readable on the class, shown by help()
    assert inspect.signature(RuleConfig).parameters["enabled"].default is None
    assert RuleConfig().enabled is RuleConfig(enabled=None).enabled is None
    every = [*BUILTIN_RULES, wide_output]
    assert [r.name for r in RuleConfig().select(every)] == [*RULES, "wide_output"]  # with the largest order
    assert "wide_output" not in [r.name for r in RuleConfig(enabled=RULES).select(every)]  # kept as given

    def attributes(cls: type) -> list[str]:  # help() says what every field is, one Attributes line each
        section = (cls.__doc__ or "").partition("Attributes:\n")[2].partition("\n\n")[0]
        return re.findall(r"^ {8}(\w+):", section, re.MULTILINE)

    assert attributes(RuleConfig) == [f.name for f in dataclasses.fields(RuleConfig)]
    assert attributes(Baseline) == ["step", "values"]


def test_a_misspelt_reads_entry_is_named_when_the_fit_starts():
    misread = rule(order=99, phase="forward", stat="act_std", name="misread", reads=["trips"])(lambda ctx: [])
    callback = LayerHealthCallback(extensions=[misread])
    with pytest.raises(ValueError, match="names no fact of the step") as info:
        make_trainer([callback], max_steps=1).fit(TinyModule())
    for fact in ("'misread'", "'trips'", "'trip'", "'param_facts'"):  # the rule, the bad name, the valid names
        assert fact in str(info.value)


def test_loss_spike_runs_only_with_a_trip():
    assert BUILT_IN["loss_spike"].reads == ("trip",)
    assert run_rules({}, [], [], step=0, config=RuleConfig(enabled=["loss_spike"])) == []
