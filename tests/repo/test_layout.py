"""The layout of tests/ that CONTRIBUTING.md describes: helpers in one package, no test importing another, unique file
names, ``slow`` marks.

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


def imported_modules(source: str) -> set[str]:
    """The top-level names of every module that ``source`` imports, at any depth (``from a.b import c`` gives ``a``)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.partition(".")[0])
    return out


def test_imported_modules_reads_every_import():
    source = "import a.b as c\nfrom d.e import f\nfrom . import g\ndef h():\n    from conftest import i\n"
    assert imported_modules(source) == {"a", "d", "conftest"}


def test_tests_import_helpers_from_the_helpers_package_never_from_a_test_module_or_conftest():
    """A shared helper lives in ``tests/helpers``: a test module imported by another runs its tests' module code twice
    under two names, and ``conftest`` is pytest's, for fixtures and hooks only."""
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")}
    offending = {}
    for path in TESTS.rglob("*.py"):
        wrong = imported_modules(path.read_text()) & (test_modules | {"conftest"})
        if wrong:
            offending[str(path.relative_to(TESTS))] = sorted(wrong)
    assert not offending, offending


def test_the_path_holds_the_helpers_root_and_the_bug_case_library_only(pytestconfig):
    on_path = {Path(p).resolve() for p in pytestconfig.getini("pythonpath")}
    assert on_path == {TESTS, TESTS / "bugs"}, on_path
    assert (TESTS / "helpers" / "__init__.py").is_file()


def test_file_names_are_unique_across_tests():
    repeated = [name for name, n in Counter(p.name for p in TESTS.rglob("*.py")).items() if n > 1]
    assert not repeated, f"pytest imports a test file by its name from its folder, so these clash: {repeated}"


def test_every_multi_process_module_and_the_zoo_are_slow():
    modules = [*(TESTS / "distributed").glob("test_*.py"), TESTS / "integration" / "test_rules_zoo.py"]
    assert len(modules) > 1
    unmarked = [str(p.relative_to(TESTS)) for p in modules if not marked_slow(p.read_text())]
    assert not unmarked, f"without pytestmark = pytest.mark.slow: {unmarked}"
