"""The pure builders of one step's logged metrics, the rules' values and the one-time notes (hand-written cases)."""

from __future__ import annotations

import math

import pytest

from lightning_hookdiag._keys import parse_key
from lightning_hookdiag._logged_values import (
    KeyCache,
    Note,
    ObservedStep,
    StepFacts,
    histogram_note,
    histogram_series,
    late_note,
    no_logger_note,
    opt_in_note,
    parameter_facts,
    step_notes,
    step_values,
)
from lightning_hookdiag._vocabulary import counted_by_gradient

NAN = float("nan")
INF = float("inf")
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


def observed(facts=None, **fields) -> ObservedStep:
    """A step with ``fields`` and ``facts`` (by name) and nothing else: nothing unobserved, no missing gradient."""
    empty = {"step": 0, "layers": True, "trip": None, "host": {}, "wanted": [], "unobserved": StepFacts()}
    lists = {"forward_order": [], "backward_order": []}
    return ObservedStep(**{**empty, **lists, **fields}, facts=facts or {})


def build(values, wanted, precursors=None, **kwargs):
    forward = ["head", "enc", "enc.inner"]
    step = observed(host=values, wanted=wanted, forward_order=forward, facts={"precursors": precursors or {}})
    return step_values(step, **{"keys": KeyCache("p"), "layer_names": LAYERS, "param_names": PARAMS, **kwargs})


def layer_notes(step, names, count, facts, layers_observed=True, **kwargs):
    return step_notes(
        observed(step=step, host={"count": count}, unobserved=facts, layers=layers_observed), names, **kwargs
    )


def test_layer_statistics_exist_where_the_layer_ran_and_gradient_ones_where_a_gradient_arrived():
    values = host(
        act_std=[1.5, 9.0, 0.25],
        act_grad_norm=[3.0, 9.0, 9.0],
        act_grad_overflow_frac_float16=[0.5, 9.0, 9.0],
        param_norm=[2.0, 9.0],
    )
    wanted = ["act_std", "act_grad_norm", "act_grad_overflow_frac_float16", "param_norm"]
    metrics, by_stat = build(values, wanted)
    # The depth in each key is the layer's place in the forward order (head, enc, enc.inner); a parameter takes its
    # module's. The summary group has the worst value of each statistic of SUMMARIES.
    assert metrics == {
        "p.act_std/1_enc": 1.5,
        "p.act_std/0_head": 0.25,
        "p/act_std_min": 0.25,
        "p.act_grad_norm/1_enc": 3.0,
        "p/act_grad_norm_min": 3.0,
        "p/act_grad_norm_max": 3.0,
        "p.act_grad_overflow_frac_float16/1_enc": 0.5,
        "p.param_norm/1_enc.weight": 2.0,
        "p/grad_norm_total": 5.0,
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
    assert math.isnan(metrics["p.act_mean/1_enc"])
    assert "p.act_dead_frac/1_enc" not in metrics
    assert metrics["p/act_dead_frac_max"] == 0.5  # the summary of the logged values only


def test_no_grad_norm_total_without_a_measured_parameter_or_when_not_asked_for():
    assert "p/grad_norm_total" not in build(host(param_seen=[0.0, 0.0]), [])[0]
    assert "p/grad_norm_total" not in build(host(), [], total=False)[0]


def test_precursors_are_logged_by_their_own_names_and_nan_means_not_seen():
    values = host(attn_logit_max=[12.0, NAN], logit_lse_mean=[4.0], logit_absmax=[NAN])
    precursors = {"attn_logit_max": ["enc", "head"], "logit_lse_mean": ["head"], "logit_absmax": [""]}
    metrics, by_stat = build(values, [], precursors=precursors)
    assert by_stat == {"attn_logit_max": {"enc": 12.0}, "logit_lse_mean": {"head": 4.0}}
    assert metrics["p.attn_logit_max/1_enc"] == 12.0
    assert metrics["p.logit_lse_mean/0_head"] == 4.0
    assert "p.attn_logit_max/0_head" not in metrics


def test_a_value_with_no_owner_is_dropped_and_step_loss_reaches_only_the_rules():
    # The output layer of logit_lse_mean ran outside every module (owner ""): a value, but no layer to name.
    values = host(logit_lse_mean=[4.0], step_loss=[0.5])
    metrics, by_stat = build(values, [], precursors={"logit_lse_mean": [""], "step_loss": ["loss"]})
    assert by_stat == {"step_loss": {"loss": 0.5}}  # what logit_drift compares the drift with
    parsed = [parse_key(key, "p") for key in metrics]
    assert not [key for key in parsed if key is None or key.stat in ("logit_lse_mean", "step_loss")]


def test_stale_gradients_and_replica_minima_reach_the_rules_as_facts_but_are_not_logged():
    values = host(stale_grad_sq=[9.0, 0.0], param_norm_min=[1.5, 7.0], param_norm=[2.0, 9.0])
    metrics, by_stat = build(values, ["param_norm"])
    facts = parameter_facts(values, PARAMS)
    assert facts["param_stale_grad_norm"] == {"enc.weight": 3.0}  # sqrt(9); a zero is no stale gradient
    assert facts["param_norm_min"] == {"enc.weight": 1.5}  # only the parameters that were measured
    assert by_stat.keys() == {"param_norm"}
    assert not [k for k in metrics if "stale" in k or "min" in k]


def test_keys_are_formatted_once_per_statistic_and_again_when_the_names_or_the_numbering_change():
    keys = KeyCache("h", n_layers=12)  # two digits of depth
    keys.number(["b", "a", "c"])
    first = keys.keys("act_std", ["a", "b"])
    assert keys.keys("act_std", ["a", "b"]) is first
    assert keys.keys("act_std", ["a", "b", "c"]) == ["h.act_std/01_a", "h.act_std/00_b", "h.act_std/02_c"]
    # A renamed parameter (a reparametrisation) keeps the number of names: the names themselves decide.
    assert keys.keys("act_std", ["a", "z", "c"]) == ["h.act_std/01_a", "h.act_std/xx_z", "h.act_std/02_c"]
    names = ["a", "b"]
    assert keys.keys("act_std", names) == ["h.act_std/01_a", "h.act_std/00_b"]
    names[1] = "y"  # changed in place: the cache holds its own copy of the names
    assert keys.keys("act_std", names) == ["h.act_std/01_a", "h.act_std/xx_y"]
    # A layer first seen later is numbered after the known ones, whose numbers stay.
    keys.number(["y", "a"])
    assert keys.keys("act_std", names) == ["h.act_std/01_a", "h.act_std/03_y"]
    assert keys.key("param_norm", "y.weight", parameter=True) == "h.param_norm/03_y.weight"
    assert keys.key("param_norm", "scale", parameter=True) == "h.param_norm/xx_scale"
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
    facts_by_note = [
        ("'mlp'", "changed between calls or differs between processes", "act_dead_frac is not tracked"),
        ("'emb'", "no floating-point tensor", "not observed"),
        ("'sparse'", "is a sparse tensor", "not observed"),
        ("'mlp.drop'", "did not run during sampled step 5"),
        ("'empty'", "ran during sampled step 5", "no elements"),
        ("'skipped'", "did not run during sampled step 5", "a branch was not taken"),
        ("'quiet'", "did not run during sampled step 5"),
    ]
    for note, facts in zip(notes, facts_by_note, strict=True):
        assert note.message.startswith("LayerHealthCallback: ")
        for fact in facts:
            assert fact in note.message, (note.key, fact)


def test_the_sparse_notes_follow_the_layer_names_and_the_others_the_layer_order():
    names = ["zeta", "alpha", "mid"]
    facts = StepFacts(unit_mismatch=frozenset({0, 1}), sparse=frozenset({0, 1}), no_float=frozenset({2}))
    keys = [n.key for n in layer_notes(0, names, [1.0, 1.0, 0.0], facts)]
    assert keys == ["unit_mismatch:zeta", "unit_mismatch:alpha", "no_float:mid", "sparse:alpha", "sparse:zeta"]


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
    (note,) = step_notes(observed(host={"count": []}, facts={"missing_grads": ["pooler"]}), [])
    assert (note.key, note.info) == ("no_grad:pooler", True)
    for fact in ("'pooler'", "required grad but received no gradient", "no act_grad statistics"):
        assert fact in note.message
    assert histogram_note([]) is None
    note = histogram_note(["CSVLogger", "RecordingLogger"])
    assert (note.key, note.info) == ("histograms:CSVLogger,RecordingLogger", True)
    for fact in ("CSVLogger, RecordingLogger", "cannot store histograms", "TensorBoard and W&B"):
        assert fact in note.message
    assert opt_in_note("") is None
    note = opt_in_note("act_overflow_frac: no target")
    assert (note.key, note.info) == ("opt_in_note", True)
    assert note.message.startswith("LayerHealthCallback: ")
    assert note.message.endswith("act_overflow_frac: no target")


def test_histograms_are_cut_into_one_series_per_layer_and_kind_with_open_outer_bins():
    inner = [-1e4, -1e-6, 0.0, 1e-6, 1e4]  # 6 bins per layer
    act = [0, 1, 2, 3, 4, 5] + [0] * 6 + [7, 0, 0, 0, 0, 1]
    grad = [0] * 6 + [0, 0, 9, 9, 0, 0] + [0] * 6
    keys = KeyCache("lh", n_layers=len(LAYERS))
    keys.number(LAYERS)
    h = histogram_series(act, grad, inner, keys=keys, layer_names=LAYERS)
    assert h.left == [-1e5, -1e4, -1e-6, 0.0, 1e-6, 1e4]
    assert h.right == [-1e4, -1e-6, 0.0, 1e-6, 1e4, 1e5]
    # Layers without a counted value (enc.inner's outputs, every gradient but enc.inner's) have no series.
    assert h.series == [
        ("lh.act_hist/0_enc", [0, 1, 2, 3, 4, 5]),
        ("lh.act_hist/2_head", [7, 0, 0, 0, 0, 1]),
        ("lh.act_grad_hist/1_enc.inner", [0, 0, 9, 9, 0, 0]),
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


def test_an_overflow_is_a_non_finite_statistic_of_finite_values_of_a_layer_that_ran():
    host = {
        "count": [4.0, 4.0, 0.0, 4.0],
        "act_nonfinite": [0.0, 3.0, 0.0, 0.0],  # fc2 held NaN/Inf: its NaN statistic is no overflow
        "act_std": [INF, NAN, NAN, 1.0],  # fc3 did not run: NaN means nothing was observed
        "grad_count": [2.0, 0.0, 0.0, 2.0],
        "act_grad_nonfinite": [0.0, 0.0, 0.0, 0.0],
        "act_grad_norm": [1.0, NAN, NAN, INF],
    }
    notes = [n for n in step_notes(observed(host=host), ["fc1", "fc2", "fc3", "fc4"]) if n.key.startswith("overflow:")]
    assert [n.key for n in notes] == ["overflow:act_std:fc1", "overflow:act_grad_norm:fc4"]
    for fact in ("'fc1'", "inf", "output held no NaN/Inf"):
        assert fact in notes[0].message
    assert "output gradient held no NaN/Inf" in notes[1].message
    # without the count of non-finite elements nothing is judged
    assert step_notes(observed(host={"count": [4.0], "act_std": [INF]}), ["fc1"]) == []


def test_the_late_and_no_logger_notes_name_their_facts():
    assert late_note(None, 4, 3) is None
    note = late_note(3, 4, 3)
    assert (note.key, note.info) == ("late", True)
    assert "optimizer step 3 (every_n_steps=3)" in note.message
    assert "first optimizer step, 4" in note.message
    assert no_logger_note(1) is None
    note = no_logger_note(0)
    assert note.info
    assert "logger=False" in note.message
    assert "callback.last_metrics" in note.message


def test_a_statistic_of_the_output_gradient_is_counted_where_a_gradient_arrived():
    stats = ["act_mean", "act_grad_norm", "act_grad_nonfinite", "act_grad_underflow_frac_bfloat16", "act_kurtosis"]
    assert [s for s in stats if counted_by_gradient(s)] == stats[1:4]


def test_step_notes_are_the_layer_notes_then_the_missing_gradients_then_the_overflows():
    host = {"count": [4.0, 0.0], "act_nonfinite": [0.0, 0.0], "act_mean": [INF, NAN]}
    notes = step_notes(observed(host=host, facts={"missing_grads": ["a"]}), ["a", "b"])
    assert [n.key for n in notes] == ["not_run:b", "no_grad:a", "overflow:act_mean:a"]
