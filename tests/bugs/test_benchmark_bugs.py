"""Smoke test of benchmarks/bugs.py: one table row per case, the totals and the DeepDiagnosis comparison."""

import importlib.util
import sys
from pathlib import Path

import pytest
from cases import CASES

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bugs.py"


@pytest.mark.slow
def test_the_bug_table_has_a_row_per_case_and_totals(capsys, monkeypatch):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bugs_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts tests/ and tests/bugs/ first
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    table = out.split("**Totals")[0].splitlines()  # the bug table (the categories table below also has backticks)
    rows = [line for line in table if line.startswith("| ") and "`" in line.split("|")[3]]
    rows += [line for line in table if line.startswith("| ") and "(blind spot)" in line]
    assert sorted(line.split("|")[1].strip(" †") for line in rows) == sorted(c.name for c in CASES)
    assert f"false alarms on 0/{len(CASES)} fixed twins and on 0/7 healthy zoo models" in out
    assert "| bugs localised |" in out
    assert "34/53" in out
    named = {name for _, _, names in module.CATEGORIES for name in names}
    assert named <= {c.name for c in CASES}  # every category lists real cases
