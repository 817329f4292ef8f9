"""The trend history (lightning_hookdiag._trends) and the three precursor rules on hand-made values."""

from __future__ import annotations

import json
import math
import pickle

import pytest
from helpers import run_rules

from lightning_hookdiag._trends import History, crossing_step, log_slope, rising_share
from lightning_hookdiag.rules import RuleConfig


def _history(points: dict[str, dict[str, list[tuple[int, float]]]], window: int = 32) -> History:
    history = History(window)
    steps = sorted({s for group in points.values() for ps in group.values() for s, _ in ps})
    for step in steps:
        values = {
            stat: {name: v for name, ps in group.items() for s, v in ps if s == step} for stat, group in points.items()
        }
        history.push(step, values)
    return history


def test_history_keeps_the_last_window_of_finite_values_and_round_trips():
    history = History(3)
    for step, value in enumerate([1.0, math.nan, 2.0, 3.0, 4.0]):
        history.push(step, {"attn_logit_max": {"a": value}, "act_mean": {"a": 9.0}})
    history.push(4, {"attn_logit_max": {"a": 99.0}})  # the same step again (a replay) adds nothing
    assert history.points("attn_logit_max", "a") == [(2, 2.0), (3, 3.0), (4, 4.0)]
    assert "act_mean" not in history.state_dict()["points"]  # untracked statistic
    state = json.loads(json.dumps(history.state_dict()))
    restored = History(3)
    restored.load_state_dict(state)
    assert restored.points("attn_logit_max", "a") == history.points("attn_logit_max", "a")
    assert pickle.loads(pickle.dumps(history)).points("attn_logit_max", "a") == [(2, 2.0), (3, 3.0), (4, 4.0)]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"points": [1]}, r"'points' expects \{stat: \{name: \[\[step, value\]\]\}\}, got \[1\]"),
        ({"points": {"a": 3}}, r"'a' expects \{name: \[\[step, value\]\]\}, got 3"),
        ({"points": {"a": {"b": [[1]]}}}, r"a/b expects \[\[step, value\], \.\.\.\], got \[\[1\]\]"),
    ],
)
def test_history_rejects_a_malformed_state(state, message):
    with pytest.raises(ValueError, match=message):
        History().load_state_dict(state)


@pytest.mark.parametrize("window", [1, 2.0, True])
def test_history_rejects_a_bad_window(window):
    with pytest.raises(ValueError, match=rf"History: window expected an integer >= 2, got {window!r}"):
        History(window)


def test_trend_helpers_against_hand_computed_values():
    points = [(0, 1.0), (2, math.e**2), (4, math.e**4)]
    assert log_slope(points) == pytest.approx(1.0)
    assert crossing_step(points, math.e**6.5) == 7  # 4 + ceil(2.5 / 1)
    assert crossing_step(points, 10.0) == 4  # already above
    assert crossing_step([(0, 2.0), (1, 1.0)], 10.0) is None
    assert math.isnan(log_slope([(0, 1.0)]))
    assert math.isnan(log_slope([(0, 0.0), (1, 1.0)]))
    assert rising_share([(0, 1.0), (1, 1.0), (2, 2.0)]) == 0.5
    assert rising_share([(0, 1.0), (1, 2.0), (2, 1.5), (3, 3.0)]) == pytest.approx(2 / 3)  # a fall between rises
    assert math.isnan(rising_share([(0, 1.0)]))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("attn_logit_threshold", 0, "attn_logit_threshold: expected a finite number > 0, got 0"),
        ("attn_logit_threshold", math.inf, "attn_logit_threshold: expected a finite number > 0, got inf"),
        ("attn_trend_floor", 50.0, r"attn_trend_floor: expected a number in \[0, attn_logit_threshold=50\), got 50.0"),
        ("attn_trend_floor", -1, r"attn_trend_floor: expected a number in \[0, attn_logit_threshold=50\), got -1"),
        ("attn_trend_horizon", 0, "attn_trend_horizon: expected an integer >= 1, got 0"),
        ("attn_trend_horizon", 2.5, "attn_trend_horizon: expected an integer >= 1, got 2.5"),
        ("trend_window", 2, "trend_window: expected an integer >= 3, got 2"),
        ("trend_window", True, "trend_window: expected an integer >= 3, got True"),
        ("logit_drift_nats", -1.0, "logit_drift_nats: expected a finite number > 0, got -1.0"),
        ("drift_loss_tolerance", 1.0, r"drift_loss_tolerance: expected a number in \(0, 1\), got 1.0"),
        ("update_jump_ratio", 1.0, "update_jump_ratio: expected a finite number > 1, got 1.0"),
        ("update_jump_ratio", "2", "update_jump_ratio: expected a finite number > 1, got '2'"),
    ],
)
def test_precursor_settings_are_validated(field, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        RuleConfig(**{field: value})


def _attention(step: int, value: float, history: History, **config) -> list:
    values = {"attn_logit_max": {"attn": value}}
    return run_rules(values, ["attn"], [], step, RuleConfig(**config), history=history)


def test_attention_level_fires_without_history_and_trend_waits_for_the_window():
    assert [f.value for f in _attention(0, 60.0, History())] == [60.0]
    assert _attention(0, 49.0, History()) == []
    # 1.2x a step from 8: projected to cross 50 within 10 steps, but 7 earlier points are needed.
    rising = [(s, 8.0 * 1.2**s) for s in range(8)]
    few = _history({"attn_logit_max": {"attn": rising[:6]}})
    assert _attention(6, rising[6][1], few) == []
    full = _history({"attn_logit_max": {"attn": rising[:7]}})
    (finding,) = _attention(7, rising[7][1], full)
    expected = 7 + math.ceil(math.log(50.0 / rising[7][1]) / math.log(1.2))
    assert f"crosses attn_logit_threshold=50 at about step {expected}" in finding.message
    assert (finding.layer, finding.stat, finding.phase, finding.threshold) == ("attn", "attn_logit_max", "forward", 50)


def test_attention_trend_is_silent_below_the_floor_when_slow_or_unsteady():
    fast = [(s, 1.5**s) for s in range(8)]  # 1 -> 17: crosses 50 within 3 steps
    assert _attention(7, fast[7][1], _history({"attn_logit_max": {"attn": fast[:7]}}))
    assert not _attention(7, fast[7][1], _history({"attn_logit_max": {"attn": fast[:7]}}), attn_trend_floor=20.0)
    slow = [(s, 20.0 * 1.01**s) for s in range(8)]  # crossing in ~90 steps: beyond the horizon of 10
    assert not _attention(7, slow[7][1], _history({"attn_logit_max": {"attn": slow[:7]}}))
    zigzag = [(s, 30.0 if s % 2 else 20.0) for s in range(7)]  # 3 of the 7 pairs fall, though it ends high
    assert not _attention(7, 45.0, _history({"attn_logit_max": {"attn": zigzag}}))
    assert _attention(7, 45.0, _history({"attn_logit_max": {"attn": [(s, 20.0 + 3 * s) for s in range(7)]}}))


def _drift(lse: list[float], loss: list[float], link: float = 2.0, **config) -> list:
    *earlier_lse, now_lse = lse
    *earlier_loss, now_loss = loss
    history = _history(
        {
            "logit_lse_mean": {"head": list(enumerate(earlier_lse))},
            "step_loss": {"loss": list(enumerate(earlier_loss))},
        }
    )
    values = {"logit_lse_mean": {"head": now_lse}, "step_loss": {"loss": now_loss}, "output_link": {"head": link}}
    return run_rules(values, ["head"], [], len(lse) - 1, RuleConfig(**config), history=history)


def test_logit_drift_needs_a_flat_loss_a_large_move_and_enough_history():
    flat = [2.0] * 12
    (finding,) = _drift([4.0 + 0.5 * s for s in range(12)], flat)
    assert finding.value == pytest.approx(5.5)  # from step 0, the earliest start that qualifies
    assert (finding.layer, finding.stat, finding.rule) == ("head", "logit_lse_mean", "logit_drift")
    # Only where a softmax reads the head: not through a sigmoid (1), nor a regression loss (0).
    assert _drift([4.0 + 0.5 * s for s in range(12)], flat, link=1.0) == []
    assert _drift([4.0 + 0.5 * s for s in range(12)], flat, link=0.0) == []
    assert _drift([4.0 + 0.5 * s for s in range(12)], [2.0 - 0.05 * s for s in range(12)]) == []  # loss moved too
    assert _drift([4.0 + 0.4 * s for s in range(12)], flat) == []  # 4.4 nats < 5
    assert _drift([4.0, 10.0, 10.0, 10.0], [2.0] * 4) == []  # fewer than trend_window=8 points
    # The earliest start with a flat loss since: the loss fell early, then stayed flat while log Z climbed.
    loss = [3.0, 2.0, *[2.0] * 10]
    (finding,) = _drift([4.0 + 0.6 * s for s in range(12)], loss)
    assert finding.value == pytest.approx(0.6 * 10)


def _updates(history_norms: dict[str, list[float]], now: dict[str, float]) -> list:
    # update = ratio * norm; with norm 1 the ratio is the update norm.
    points = {
        "param_update_ratio": {p: list(enumerate(v)) for p, v in history_norms.items()},
        "param_norm": {p: [(s, 1.0) for s in range(len(v))] for p, v in history_norms.items()},
    }
    step = len(next(iter(history_norms.values())))
    values = {"param_update_ratio": now, "param_norm": dict.fromkeys(now, 1.0)}
    layers = sorted({p.rsplit(".", 1)[0] for p in now})
    return run_rules(values, layers, [], step, RuleConfig(), history=_history(points))


def test_update_jump_per_layer_against_its_median_and_the_median_layer():
    steady = [1.0, 1.2, 0.9, 1.1, 1.0, 1.0, 1.05]
    history = {"a.weight": steady, "a.bias": steady, "b.weight": steady, "c.weight": steady}
    # Layer a: sqrt(6**2 + 6**2) against its median sqrt(2) * 1.0: 6x; the median layer's jump is 1.
    (finding,) = _updates(history, {"a.weight": 6.0, "a.bias": 6.0, "b.weight": 1.0, "c.weight": 1.0})
    assert (finding.layer, finding.rule, finding.stat, finding.phase) == (
        "a",
        "update_jump",
        "param_update_ratio",
        "backward",
    )
    assert finding.value == pytest.approx(6.0)
    assert _updates(history, {"a.weight": 4.5, "a.bias": 4.5, "b.weight": 1.0, "c.weight": 1.0}) == []
    # Every layer jumping together (a learning-rate schedule) is not a layer's precursor.
    assert _updates(history, {"a.weight": 6.0, "a.bias": 6.0, "b.weight": 6.0, "c.weight": 6.0}) == []
    # Quiet until 7 earlier updates exist.
    short = {p: v[:5] for p, v in history.items()}
    assert _updates(short, {"a.weight": 9.0, "a.bias": 9.0, "b.weight": 1.0, "c.weight": 1.0}) == []
