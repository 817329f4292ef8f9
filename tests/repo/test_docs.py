"""The documentation stays true to the repository: links resolve, every statistic and every rule is documented, and
the README's commands are the ones CI runs.

Each test checks a fact that a reader relies on and that a change of the code or of a page can make false; none
polices how the prose is written (its length, its tables, its wording). The link checker and the key-table reader
are small functions tested on hand-written pages first, so that a checker that finds nothing cannot pass for a
documentation that is right.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

import pytest

import lightning_hookdiag
from lightning_hookdiag import _vocabulary as vocabulary
from lightning_hookdiag.rules import RULES, RuleConfig

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
STATISTICS = ROOT / "docs" / "statistics.md"
DOCS = sorted([README, ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])
RULES_PAGE = ROOT / "docs" / "rules.md"
SENTINEL_PAGE = ROOT / "docs" / "sentinel.md"
MODULES = sorted(Path(lightning_hookdiag.__file__).parent.rglob("*.py"))

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
KEY = re.compile(r"`(?:layer_health)[./]([A-Za-z0-9_<>]+)(?:/[^`]*)?`")
TABLE_SECTION = "Every key"
DOCSTRING_LINK = re.compile(r"``((?:docs/[\w.-]+|README|CONTRIBUTING)\.md(?:#[\w-]+)?)``")
# Keys of the key table that are not statistics of the vocabulary (layer metadata and histograms).
NOT_STATISTICS = {"alerts_active", "act_hist", "act_grad_hist", "<stat>_min", "<stat>_max"}
# The precision statistics are logged once per target dtype, as ``<name>_<dtype>``.
DTYPE_SUFFIX = "_<dtype>"


# ------------------------------------------------------------------------------------------------ the readers
def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of the text outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation (``*`` too) dropped, spaces as
    hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    kept = "".join(c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's ``-1``, ``-2`` suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link and image outside code whose target is not a URL."""
    out = []
    for number, line in prose_lines(text):
        line = CODE_SPAN.sub(lambda m: "`" + " " * len(m.group(2)) + "`", line)
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                out.append((number, target))
    return out


def broken_links(page: Path, root: Path) -> list[str]:
    """``"line N: target (why)"`` for every relative link of ``page`` that does not resolve inside ``root``."""
    problems = []
    for number, target in relative_links(page.read_text(encoding="utf-8")):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if root.resolve() not in (resolved, *resolved.parents):
            problems.append(f"line {number}: {target} (points outside the repository)")
        elif not resolved.exists():
            problems.append(f"line {number}: {target} (no such file: {resolved.relative_to(root.resolve())})")
        elif anchor and resolved.suffix != ".md":
            problems.append(f"line {number}: {target} (an anchor into a file that is not Markdown)")
        elif anchor and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            known = ", ".join(sorted(anchors(resolved.read_text(encoding="utf-8"))))
            problems.append(f"line {number}: {target} (no heading #{anchor} there; its anchors: {known})")
    return problems


def section(text: str, title: str) -> str:
    """The text under the heading ``title`` up to the next heading of the same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = HEADING.match(line)
        if match and match.group(2) == title:
            level = len(match.group(1))
            end = next(
                (
                    j
                    for j in range(i + 1, len(lines))
                    if (m := HEADING.match(lines[j])) is not None and len(m.group(1)) <= level
                ),
                len(lines),
            )
            return "\n".join(lines[i + 1 : end])
    raise AssertionError(f"no heading {title!r}")


def documented_statistics(table: str) -> dict[str, str]:
    """``{statistic: definition}`` of the rows of a key table whose key cell is a ``layer_health/<stat>...`` key."""
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 2:
            continue
        for stat in KEY.findall(cells[0]):
            out[stat.removesuffix(DTYPE_SUFFIX)] = cells[1]
    return out


def undocumented(statistics: Iterable[str], table: str) -> list[str]:
    """The statistics without a row (with a definition) in ``table``, in the order given."""
    rows = documented_statistics(table)
    return [s for s in statistics if not rows.get(s)]


def vocabulary_statistics() -> list[str]:
    """Every statistic name in every public tuple of :mod:`lightning_hookdiag._vocabulary`, first seen first.

    Read from the module's ``__all__`` rather than from a list written here, so that a statistic (or a new group of
    statistics) added to the vocabulary later is checked without touching this test.
    """
    names: dict[str, None] = {}
    for attribute in vocabulary.__all__:
        value = getattr(vocabulary, attribute)
        if isinstance(value, (tuple, list, set, frozenset)) and all(isinstance(v, str) for v in value):
            names.update(dict.fromkeys(value))
    return list(names)


def broken_docstring_links(docstring: str, root: Path) -> list[str]:
    """``"target (why)"`` for every ````docs/page.md#anchor```` a docstring names that does not resolve in ``root``."""
    problems = []
    for target in DOCSTRING_LINK.findall(docstring):
        path_part, _, anchor = target.partition("#")
        page = root / path_part
        if not page.is_file():
            problems.append(f"{target} (no such file)")
        elif anchor and anchor not in anchors(page.read_text(encoding="utf-8")):
            problems.append(f"{target} (no heading #{anchor} there)")
    return problems


# ------------------------------------------------------------------------------------- the readers themselves
def test_slug_follows_github():
    assert slug("Where do two runs first differ? `hookdiag report --diff`") == (
        "where-do-two-runs-first-differ-hookdiag-report---diff"
    )
    assert slug("Precision headroom: can this layer run in fp16 / bf16 / fp8?") == (
        "precision-headroom-can-this-layer-run-in-fp16--bf16--fp8"
    )
    assert slug("torch.compile") == "torchcompile"
    assert slug("Mixed precision (AMP)") == "mixed-precision-amp"
    assert slug("`nonfinite` and broken weights") == "nonfinite-and-broken-weights"
    assert slug("Before the host fast path (library `d40ad4`)") == "before-the-host-fast-path-library-d40ad4"
    assert anchors("# A\n## B\n```\n## not a heading\n```\n## B\n") == {"a", "b", "b-1"}


def test_link_checker_reports_each_kind_of_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section\n")
    (tmp_path / "picture.png").write_bytes(b"")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n"
        "[fine](other.md) [fine too](other.md#a-section) ![image](../picture.png) [self](#page)\n"
        "[web](https://example.com/missing.md) `[in code](missing.md)`\n"
        "```\n[in a block](missing.md)\n```\n"
        "[gone](missing.md)\n"
        "[bad anchor](other.md#no-such-section)\n"
        "[escape](../../outside.md)\n"
        "[anchor into an image](../picture.png#top)\n"
    )
    assert broken_links(page, tmp_path) == [
        "line 7: missing.md (no such file: docs/missing.md)",
        "line 8: other.md#no-such-section (no heading #no-such-section there; its anchors: a-section, other-page)",
        "line 9: ../../outside.md (points outside the repository)",
        "line 10: ../picture.png#top (an anchor into a file that is not Markdown)",
    ]


def test_key_table_reader_names_a_statistic_added_later():
    table = (
        "| key | value |\n|---|---|\n"
        "| `layer_health/act_mean/<layer>` | mean of the output |\n"
        "| `layer_health/act_overflow_frac_<dtype>/<layer>` | share that overflows, `\\|x\\|` large |\n"
        "| `layer_health/grad_norm_total` | total norm |\n"
        "| `layer_health/act_std/<layer>` |  |\n"
    )
    assert documented_statistics(table) == {
        "act_mean": "mean of the output",
        "act_overflow_frac": "share that overflows, `\\|x\\|` large",
        "grad_norm_total": "total norm",
        "act_std": "",
    }
    # A row without a definition does not count; a statistic the table lacks is named.
    stats = ["act_mean", "act_std", "act_overflow_frac", "grad_norm_total", "act_brand_new"]
    assert undocumented(stats, table) == ["act_std", "act_brand_new"]


def test_broken_docstring_links_checks_files_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## `nonfinite` and broken weights\n")
    (tmp_path / "README.md").write_text("# Top\n")
    docstring = (
        "See ``docs/page.md``, ``docs/page.md#nonfinite-and-broken-weights``, ``README.md#top``;\n"
        "not ``docs/gone.md``, ``docs/page.md#no-such-heading`` or ``README.md#missing``."
    )
    assert broken_docstring_links(docstring, tmp_path) == [
        "docs/gone.md (no such file)",
        "docs/page.md#no-such-heading (no heading #no-such-heading there)",
        "README.md#missing (no heading #missing there)",
    ]


# -------------------------------------------------------------------------------------------- the real pages
@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    if page == README:
        assert len(relative_links(page.read_text(encoding="utf-8"))) > 10  # the checker sees the README's links
    problems = broken_links(page, ROOT)
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in relative_links(README.read_text())}
    pages = {page.resolve() for page in (ROOT / "docs").glob("*.md")}
    assert pages, "docs/ has no pages"
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not missing, f"README.md links to no {missing}; add them to its Reference line"


def test_every_statistic_of_the_vocabulary_has_a_row_in_the_key_table():
    statistics = vocabulary_statistics()
    assert set(vocabulary.ALL_STATS) | set(vocabulary.OPT_IN_STATS) <= set(statistics)
    table = section(STATISTICS.read_text(encoding="utf-8"), TABLE_SECTION)
    missing = undocumented(statistics, table)
    assert not missing, (
        f"{STATISTICS.relative_to(ROOT)} documents no {missing} in its '## {TABLE_SECTION}' table; add a row "
        "'| `layer_health/<stat>/<layer>` | what the value is |' for each (`<stat>_<dtype>` for one logged per "
        "target dtype)"
    )


def test_the_key_table_documents_no_statistic_that_does_not_exist():
    table = section(STATISTICS.read_text(encoding="utf-8"), TABLE_SECTION)
    stale = sorted(set(documented_statistics(table)) - set(vocabulary_statistics()) - NOT_STATISTICS)
    assert not stale, f"{STATISTICS.relative_to(ROOT)}'s key table has rows for {stale}, which the vocabulary lacks"


# ------------------------------------------------------------------------------------ the README and .ci/run
def ci_commands() -> list[str]:
    """The fresh-machine test command of ``.ci/run``: create the venv, install, run the whole suite."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    venv = next(line for line in lines if line.startswith("python3 -m venv "))
    install = next(line for line in lines if line.startswith(".venv/bin/pip install "))
    pytest_run = next(line for line in lines if line.startswith(".venv/bin/python -m pytest"))
    return [" ".join(c.replace(" --quiet", "").split()) for c in (venv, install, pytest_run)]


def shell_lines(text: str) -> list[str]:
    """The lines of the fenced ``bash`` blocks of a Markdown page."""
    out, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside and line.strip() == "```bash"
        elif inside:
            out.append(line.strip())
    return out


def test_readme_test_command_is_the_one_ci_runs():
    commands = ci_commands()
    assert commands[2] == ".venv/bin/python -m pytest", commands  # the whole suite, as configured in pyproject
    expected = " && ".join(commands)
    assert expected in shell_lines(README.read_text()), f"README.md should show the test command {expected!r}"
    assert expected in shell_lines((ROOT / "CONTRIBUTING.md").read_text())


def test_readme_first_command_sets_up_with_ci_commands_and_runs_an_example_that_exists():
    venv, install, _ = ci_commands()
    first = shell_lines(README.read_text())[0]
    set_up = f"{venv} && {install.replace('.[dev]', '.[examples]')} && .venv/bin/python "
    assert first.startswith(set_up), f"README.md's first command should start with {set_up!r}, got {first!r}"
    script = first.removeprefix(set_up)
    assert re.fullmatch(r"examples/\w+\.py", script), script
    assert (ROOT / script).is_file()


def test_readme_examples_table_lists_every_example_script():
    table = section(README.read_text(), "Examples")
    listed = set(re.findall(r"^\| \[`examples/([\w.]+\.py)`\]", table, re.MULTILINE))
    scripts = {p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_")}
    assert listed == scripts, f"not in README's examples table: {sorted(scripts - listed)}; no such script: " + str(
        sorted(listed - scripts)
    )


# ---------------------------------------------------------------------------------------- the docstrings' links
def module_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def docstrings(path: Path) -> list[tuple[str, str]]:
    """``(where, docstring)`` of the module at ``path`` and of every class and function in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [
        (f"line {getattr(node, 'lineno', 1)} ({getattr(node, 'name', 'module')})", ast.get_docstring(node) or "")
        for node in ast.walk(tree)
        if isinstance(node, kinds)
    ]


def test_docstrings_reads_classes_and_functions_too(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Mod."""\nclass A:\n    """Cls."""\n    def f(self):\n        """Fn."""\n')
    assert docstrings(path) == [("line 1 (module)", "Mod."), ("line 2 (A)", "Cls."), ("line 4 (f)", "Fn.")]


@pytest.mark.parametrize("module", MODULES, ids=module_id)
def test_every_docstring_link_resolves(module):
    """A class's or a function's link to a docs section (a ``RuleConfig`` field's) breaks as silently as a module's."""
    problems = [f"{where}: {p}" for where, doc in docstrings(module) for p in broken_docstring_links(doc, ROOT)]
    assert not problems, f"{module_id(module)}: " + "; ".join(problems)


def test_every_rule_and_setting_is_documented():
    """The rules table left ``rules.py``: every rule needs its row in docs/rules.md, every ``RuleConfig`` field a
    mention in docs/rules.md or (the sentinel's settings) docs/sentinel.md."""
    rules_page = RULES_PAGE.read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(\w+)` \|", section(rules_page, "The rules"), re.MULTILINE))
    assert rows == set(RULES), (
        f"docs/rules.md's table lacks {sorted(set(RULES) - rows)}, has extra {sorted(rows - set(RULES))}"
    )
    pages = rules_page + SENTINEL_PAGE.read_text(encoding="utf-8")
    fields = [f.name for f in dataclasses.fields(RuleConfig) if f.name != "enabled"]
    missing = [name for name in fields if f"`{name}`" not in pages and f"`{name}=" not in pages]
    assert not missing, f"RuleConfig fields documented nowhere in docs/rules.md or docs/sentinel.md: {missing}"
