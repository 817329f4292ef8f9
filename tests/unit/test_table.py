"""table.py's edges, by hand: the unit boundaries of format_bytes, non-finite bytes, layers missing from the order."""

from __future__ import annotations

import pytest

from lightning_hookdiag._table import format_bytes, format_step_table, format_value, table_lines


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


def test_values_print_in_four_significant_digits_and_non_finite_by_name():
    assert [format_value(v) for v in (0.000123456, 1234567.0, 2.0, float("-inf"))] == [
        "0.0001235",
        "1.235e+06",
        "2",
        "-inf",
    ]


def test_table_lines_align_each_column_and_indent_by_two():
    assert table_lines(["depth", "layer"], [["0", "fc1"], ["10", "out"]], [">", "<"]) == [
        "  depth  layer",
        "      0  fc1",
        "     10  out",
    ]


def test_the_root_module_gets_a_visible_row():
    lines = format_step_table({"act_std": {"": 1.0}}, [""], {"": ["dead_units"]}, "t").splitlines()
    assert lines[2].split() == ["0", "(root)", "1", "dead_units"]
