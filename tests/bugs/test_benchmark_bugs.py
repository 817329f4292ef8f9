"""Smoke test of benchmarks/bugs.py: one table row per case, the tables by principle (the TrainCheck ports apart),
the totals and the DeepDiagnosis comparison."""

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
    monkeypatch.setitem(sys.modules, "bugs_benchmark", module)  # the script's dataclass looks its module up there
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    tables = out.split("## Every bug type")[1].split("## Categories")[0]  # the types' table, then the ports'
    names = {c.name for c in CASES}
    rows = [line.split("|")[1].strip() for line in tables.splitlines() if line.startswith("| ")]
    assert sorted(row for row in rows if row in names) == sorted(names)
    by_principle = out.split("## By principle")[1].split("**Totals")[0]
    assert by_principle.count("| **all** |") == 2  # the types, then the TrainCheck ports
    types = [c for c in CASES if not c.source]
    assert f"| **all** | **{len(types)}** |" in by_principle
    loud = sum(bool(c.twin_today) for c in CASES)  # the known false alarms on twins, on record
    assert f"False alarms on {loud}/{len(CASES)} fixed twins (ports included) and on 0/7 healthy zoo models" in out
    assert "| bugs localised |" in out
    assert "34/53" in out
    named = {name for _, _, names in module.CATEGORIES for name in names}
    assert named <= {c.name for c in CASES}  # every category lists real cases
