"""The layout of tests/ that CONTRIBUTING.md describes: every folder importable, unique file names, ``slow`` marks.

The mark checks read each module's own ``pytestmark``, so that a multi-process module added without it fails here
instead of slowing down ``-m "not slow"``.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def marked_slow(source: str) -> bool:
    """Whether a module's top level assigns ``pytestmark = pytest.mark.slow``."""
    return any(
        isinstance(node, ast.Assign)
        and [ast.unparse(t) for t in node.targets] == ["pytestmark"]
        and ast.unparse(node.value) == "pytest.mark.slow"
        for node in ast.parse(source).body
    )


def test_marked_slow_reads_only_a_module_wide_slow_mark():
    assert marked_slow("import pytest\n\npytestmark = pytest.mark.slow\n")
    assert not marked_slow("import pytest\n\n\n@pytest.mark.slow\ndef test_one(): ...\n")
    assert not marked_slow("import pytest\n\npytestmark = pytest.mark.skipif(True, reason='')\n")
    assert not marked_slow("def f():\n    pytestmark = 1\n")


def test_every_folder_of_tests_is_on_the_path(pytestconfig):
    folders = {TESTS, *(p for p in TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__")}
    on_path = {Path(p).resolve() for p in pytestconfig.getini("pythonpath")}
    assert folders == on_path, f"pyproject.toml's pythonpath lacks {folders - on_path} and lists {on_path - folders}"


def test_file_names_are_unique_across_tests():
    repeated = [name for name, n in Counter(p.name for p in TESTS.rglob("*.py")).items() if n > 1]
    assert not repeated, f"imported by name from every folder, so these clash: {repeated}"


def test_every_multi_process_module_and_the_zoo_are_slow():
    modules = [*(TESTS / "distributed").glob("test_*.py"), TESTS / "integration" / "test_rules_zoo.py"]
    assert len(modules) > 1
    unmarked = [str(p.relative_to(TESTS)) for p in modules if not marked_slow(p.read_text())]
    assert not unmarked, f"without pytestmark = pytest.mark.slow: {unmarked}"
