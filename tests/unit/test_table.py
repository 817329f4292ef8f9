"""table.py's edges, by hand: the unit boundaries of format_bytes, non-finite bytes, layers missing from the order."""

from __future__ import annotations

import pytest

from lightning_hookdiag.table import format_bytes, format_step_table


@pytest.mark.parametrize(
    ("value", "text"),
    [(1023.0, "1023 B"), (1024.0, "1.0 KiB"), (1024.0**2, "1.0 MiB"), (1024.0**3, "1.0 GiB"), (-2048.0, "-2.0 KiB")],
)
def test_bytes_switch_unit_at_1024(value, text):
    assert format_bytes(value) == text


@pytest.mark.parametrize(("value", "text"), [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_non_finite_bytes_print_without_a_unit(value, text):
    assert format_bytes(value) == text


def test_layers_missing_from_the_order_follow_in_name_order():
    values = {"act_std": {"b": 2.0, "z": 3.0, "a": 1.0}}
    lines = format_step_table(values, ["b"], {}, "t").splitlines()
    assert [line.split()[:2] for line in lines[2:]] == [["0", "b"], ["1", "a"], ["2", "z"]]
