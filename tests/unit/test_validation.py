"""The argument checks: what passes comes back normalised, and every error names the argument, what is valid and the
bad value (asserted by those facts, not by the whole sentence)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_hookdiag._validation import boolean, check, choice, integer, module_names, names, number

ABOVE_1 = ("a finite number > 1", lambda v: 1 < v < math.inf)


def test_none_is_an_error_unless_optional():
    # Mutation review: accepting None always survived.
    with pytest.raises(ValueError, match=r"^every_n_steps: expected an integer >= 1, got None$"):
        integer("every_n_steps", None, "an integer >= 1", lambda v: v >= 1)
    assert integer("unit_dim", None, "an integer axis or None", optional=True) is None


def test_what_passes_comes_back_as_plain_python():
    assert check("prefix", "a", "a key segment", lambda p: not p.endswith("/")) == "a"
    ten = number("spike_ratio", 10, *ABOVE_1)
    assert (ten, type(ten)) == (10.0, float)
    five = integer("every_n_steps", np.int64(5), "an integer >= 1", lambda v: v >= 1)
    assert (five, type(five)) == (5, int)  # a numpy integer leaks into neither arithmetic nor checkpoints
    assert boolean("summary", False) is False
    assert choice("on_anomaly", "raise", ("warn", "raise")) == "raise"
    assert module_names("layers", "model.*") == ["model.*"]
    assert module_names("exclude", ("a", "b")) == ["a", "b"]
    assert module_names("layers", None) is None
    assert names("extra_stats", "act_kurtosis", ["act_mean", "act_kurtosis"]) == ["act_kurtosis"]
    assert names("extra_stats", None, ["act_mean"]) == []


@pytest.mark.parametrize(
    ("call", "facts"),
    [
        (
            lambda: check("prefix", "a/", "a key segment without a trailing '/'", lambda p: not p.endswith("/")),
            ["prefix", "without a trailing '/'", "'a/'"],
        ),
        (lambda: number("spike_ratio", True, *ABOVE_1), ["spike_ratio", "a finite number > 1", "True"]),
        (lambda: number("spike_ratio", "10", *ABOVE_1), ["spike_ratio", "'10'"]),
        (
            lambda: integer("histogram_bins", 7, "an even integer >= 4", lambda v: v >= 4 and v % 2 == 0),
            ["histogram_bins", "an even integer >= 4", "got 7"],
        ),
        (lambda: integer("every_n_steps", 2.0, "an integer >= 1", lambda v: v >= 1), ["every_n_steps", "2.0"]),
        (lambda: integer("every_n_steps", True, "an integer >= 1", lambda v: v >= 1), ["every_n_steps", "True"]),
        (lambda: boolean("summary", "false"), ["summary", "True or False", "'false'"]),
        (lambda: boolean("summary", 1), ["summary", "got 1"]),
        (lambda: choice("on_anomaly", "log", ("warn", "raise")), ["on_anomaly", "['warn', 'raise']", "'log'"]),
        (lambda: module_names("layers", ["model.0", ""]), ["layers", "non-empty", "['']"]),
        (lambda: module_names("layers", 3), ["layers", "module name or glob", "got 3"]),
        (
            lambda: names("extra_stats", ["act_kurtosis", "act_kurt"], ["act_mean", "act_kurtosis"], "statistic"),
            ["extra_stats", "unknown statistic", "['act_kurt']", "['act_mean', 'act_kurtosis']"],
        ),
        (lambda: names("extra_stats", [3], ["act_mean"], "statistic"), ["extra_stats", "statistic name", "[3]"]),
    ],
)
def test_an_error_names_the_argument_what_is_valid_and_the_bad_value(call, facts):
    with pytest.raises(ValueError, match=rf"^{facts[0]}: ") as info:  # the argument's name first
        call()
    missing = [fact for fact in facts if fact not in str(info.value)]
    assert not missing, f"{str(info.value)!r} lacks {missing}"
