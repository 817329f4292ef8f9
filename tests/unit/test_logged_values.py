"""The pure builders of one step's logged metrics, the rules' values and the one-time notes (hand-written cases)."""

from __future__ import annotations

import math

import pytest

from lightning_hookdiag.logged_values import (
    KeyCache,
    Note,
    StepFacts,
    histogram_note,
    histogram_series,
    layer_notes,
    missing_grad_notes,
    opt_in_note,
    step_values,
)

NAN = float("nan")
LAYERS = ["enc", "enc.inner", "head"]
PARAMS = ["enc.weight", "head.weight"]


def host(**extra):
    base = {
        "count": [6.0, 0.0, 2.0],  # enc.inner did not run
        "grad_count": [6.0, 0.0, 0.0],  # no gradient reached head's output
        "param_seen": [1.0, 0.0],  # head.weight was not measured
        "grad_norm_total": [5.0],
    }
    return {**base, **extra}


def build(values, wanted, **kwargs):
    args = {
        "keys": KeyCache("p"),
        "layer_names": LAYERS,
        "param_names": PARAMS,
        "execution_order": ["head", "enc", "enc.inner"],
    }
    return step_values(values, wanted, **{**args, **kwargs})


def test_layer_statistics_exist_where_the_layer_ran_and_gradient_ones_where_a_gradient_arrived():
    values = host(
        act_std=[1.5, 9.0, 0.25],
        act_grad_norm=[3.0, 9.0, 9.0],
        act_grad_overflow_frac_float16=[0.5, 9.0, 9.0],
        param_norm=[2.0, 9.0],
    )
    wanted = ["act_std", "act_grad_norm", "act_grad_overflow_frac_float16", "param_norm"]
    metrics, by_stat = build(values, wanted)
    assert metrics == {
        "p/act_std/enc": 1.5,
        "p/act_std/head": 0.25,
        "p/act_grad_norm/enc": 3.0,
        "p/act_grad_overflow_frac_float16/enc": 0.5,
        "p/param_norm/enc.weight": 2.0,
        "p/grad_norm_total": 5.0,
        "p/depth/head": 0.0,  # the forward order, of the layers that ran
        "p/depth/enc": 1.0,
    }
    assert by_stat == {
        "act_std": {"enc": 1.5, "head": 0.25},
        "act_grad_norm": {"enc": 3.0},
        "act_grad_overflow_frac_float16": {"enc": 0.5},
        "param_norm": {"enc.weight": 2.0},
    }


def test_nan_is_dropped_only_where_it_means_undefined():
    values = host(act_dead_frac=[NAN, 9.0, 0.5], act_mean=[NAN, 9.0, 1.0], act_kurtosis=[NAN, 9.0, 3.0])
    metrics, by_stat = build(
        values, ["act_dead_frac", "act_mean", "act_kurtosis"], undefined_skipped={"act_dead_frac", "act_kurtosis"}
    )
    assert by_stat["act_dead_frac"] == {"head": 0.5}
    assert by_stat["act_kurtosis"] == {"head": 3.0}
    assert math.isnan(by_stat["act_mean"]["enc"])  # a NaN mean is news: the rules and the loggers see it
    assert math.isnan(metrics["p/act_mean/enc"])
    assert "p/act_dead_frac/enc" not in metrics


def test_no_grad_norm_total_without_a_measured_parameter_or_when_not_asked_for():
    assert "p/grad_norm_total" not in build(host(param_seen=[0.0, 0.0]), [])[0]
    assert "p/grad_norm_total" not in build(host(), [], total=False)[0]


def test_precursors_are_logged_by_their_own_names_and_nan_means_not_seen():
    values = host(attn_logit_max=[12.0, NAN], logit_lse_mean=[4.0], logit_absmax=[NAN])
    precursors = {"attn_logit_max": ["enc", "head"], "logit_lse_mean": ["head"], "logit_absmax": [""]}
    metrics, by_stat = build(values, [], precursors=precursors)
    assert by_stat == {"attn_logit_max": {"enc": 12.0}, "logit_lse_mean": {"head": 4.0}}
    assert metrics["p/attn_logit_max/enc"] == 12.0
    assert metrics["p/logit_lse_mean/head"] == 4.0
    assert "p/attn_logit_max/head" not in metrics


def test_a_value_with_no_owner_is_dropped_and_step_loss_reaches_only_the_rules():
    # The output layer of logit_lse_mean ran outside every module (owner ""): a value, but no layer to name.
    values = host(logit_lse_mean=[4.0], step_loss=[0.5])
    metrics, by_stat = build(values, [], precursors={"logit_lse_mean": [""], "step_loss": ["loss"]})
    assert by_stat == {"step_loss": {"loss": 0.5}}  # what logit_drift compares the drift with
    assert not any(key.startswith(("p/logit_lse_mean/", "p/step_loss/")) for key in metrics)


def test_stale_gradients_and_replica_minima_reach_the_rules_but_are_not_logged():
    values = host(stale_grad_sq=[9.0, 0.0], param_norm_min=[1.5, 7.0], param_norm=[2.0, 9.0])
    metrics, by_stat = build(values, ["param_norm"])
    assert by_stat["param_stale_grad_norm"] == {"enc.weight": 3.0}  # sqrt(9); a zero is no stale gradient
    assert by_stat["param_norm_min"] == {"enc.weight": 1.5}  # only the parameters that were measured
    assert not [k for k in metrics if "stale" in k or "min" in k]


def test_keys_are_formatted_once_per_statistic_and_again_when_the_names_change():
    keys = KeyCache("h")
    first = keys.keys("act_std", ["a", "b"])
    assert keys.keys("act_std", ["a", "b"]) is first
    assert keys.keys("act_std", ["a", "b", "c"]) == ["h/act_std/a", "h/act_std/b", "h/act_std/c"]
    assert keys.key("depth", "a") == "h/depth/a"
    assert keys.key("grad_norm_total") == "h/grad_norm_total"


# ------------------------------------------------------------------------------------------------------- notes
def test_every_kind_of_layer_note_in_order():
    names = ["emb", "sparse", "mlp", "mlp.drop", "empty", "skipped", "quiet"]
    count = [0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]
    facts = StepFacts(
        unit_mismatch=frozenset({2}), no_float=frozenset({0}), sparse=frozenset({1}), empty=frozenset({4})
    )
    notes = layer_notes(5, names, count, facts, quiet_not_run={"quiet"})
    assert [(n.key, n.info) for n in notes] == [
        ("unit_mismatch:mlp", False),
        ("no_float:emb", False),
        ("sparse:sparse", False),
        ("not_run:mlp.drop", True),  # inside mlp, which ran: observed through it
        ("empty:empty", False),
        ("not_run:skipped", False),
        ("not_run:quiet", True),
    ]
    assert notes[0].message == (
        "LayerHealthCallback: the number of units of 'mlp' changed between calls or differs between processes (a"
        " module shared by inputs of different widths); act_dead_frac is not tracked for it"
    )
    assert notes[1].message == (
        "LayerHealthCallback: the output of 'emb' holds no floating-point tensor; it is not observed"
    )
    assert notes[2].message == (
        "LayerHealthCallback: the output of 'sparse' (or its gradient) is a sparse tensor; sparse tensors are not"
        " observed"
    )
    assert notes[4].message == (
        "LayerHealthCallback: selected module 'empty' ran during sampled step 5 but its output had no elements; no"
        " statistics for it"
    )
    assert notes[5].message == (
        "LayerHealthCallback: selected module 'skipped' did not run during sampled step 5 (its forward was called"
        " directly instead of the module, or a branch was not taken); no statistics for it"
    )


def test_a_named_selection_warns_for_a_module_inside_one_that_ran():
    notes = layer_notes(0, ["mlp", "mlp.drop"], [4.0, 0.0], StepFacts(), default_selection=False)
    assert notes == [Note("not_run:mlp.drop", notes[0].message, info=False)]


def test_a_parameter_window_says_nothing_about_layers_that_did_not_run():
    assert layer_notes(3, ["a"], [0.0], StepFacts(), layers_observed=False) == []
    # ... but an empty output is still news
    assert [n.key for n in layer_notes(3, ["a"], [0.0], StepFacts(empty=frozenset({0})), layers_observed=False)] == [
        "empty:a"
    ]


def test_missing_gradient_histogram_and_opt_in_notes():
    assert missing_grad_notes(["pooler"]) == [
        Note(
            "no_grad:pooler",
            "LayerHealthCallback: the output of 'pooler' required grad but received no gradient on a sampled step (a"
            " detached branch, or an output that does not reach the loss); no act_grad statistics for it",
            info=True,
        )
    ]
    assert histogram_note([]) is None
    assert histogram_note(["CSVLogger", "RecordingLogger"]) == Note(
        "histograms:CSVLogger,RecordingLogger",
        "LayerHealthCallback: CSVLogger, RecordingLogger cannot store histograms; they are logged only to"
        " TensorBoard and W&B loggers",
        info=True,
    )
    assert opt_in_note("") is None
    assert opt_in_note("act_overflow_frac: no target") == Note(
        "opt_in_note", "LayerHealthCallback: act_overflow_frac: no target", info=True
    )


def test_histograms_are_cut_into_one_series_per_layer_and_kind_with_open_outer_bins():
    inner = [-1e4, -1e-6, 0.0, 1e-6, 1e4]  # 6 bins per layer
    act = [0, 1, 2, 3, 4, 5] + [0] * 6 + [7, 0, 0, 0, 0, 1]
    grad = [0] * 6 + [0, 0, 9, 9, 0, 0] + [0] * 6
    h = histogram_series(act, grad, inner, keys=KeyCache("lh"), layer_names=LAYERS)
    assert h.left == [-1e5, -1e4, -1e-6, 0.0, 1e-6, 1e4]
    assert h.right == [-1e4, -1e-6, 0.0, 1e-6, 1e4, 1e5]
    # Layers without a counted value (enc.inner's outputs, every gradient but enc.inner's) have no series.
    assert h.series == [
        ("lh/act_hist/enc", [0, 1, 2, 3, 4, 5]),
        ("lh/act_hist/head", [7, 0, 0, 0, 0, 1]),
        ("lh/act_grad_hist/enc.inner", [0, 0, 9, 9, 0, 0]),
    ]


@pytest.mark.parametrize("missing", ["count", "grad_count", "param_seen"])
def test_the_counts_are_required(missing):
    values = host()
    del values[missing]
    with pytest.raises(KeyError, match=missing):
        build(values, [])


def test_a_sibling_whose_name_extends_one_that_ran_is_not_covered():
    notes = layer_notes(2, ["fc1", "fc10", "fc1.drop"], [4.0, 0.0, 0.0], StepFacts())
    assert [(n.key, n.info) for n in notes] == [("not_run:fc10", False), ("not_run:fc1.drop", True)]
