"""Smoke test of the overhead benchmark: it runs, and its numbers are well-formed (no timing assertions)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "overhead.py"


@pytest.mark.slow
def test_quick_benchmark_runs_and_writes_json(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "overhead", module)  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    out = tmp_path / "results.json"
    module.main(["--quick", "--json", str(out)])
    written = json.loads(out.read_text())
    for model in ("mlp", "transformer", "cnn"):
        variants = written["results"][model]
        assert {"plain", "every_step", "default_interval", "tutorial"} <= set(variants)
        assert variants["plain"]["median_ms"] > 0
        assert variants["every_step"]["median_ms"] > 0
    assert written["machine"]["torch"]
