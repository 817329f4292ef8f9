"""The package's import graph: modules talk to each other through public names only (a helper that two modules
need is public in the module that owns its job, issue 22, so that a module's private names can change without
breaking another one), and no modules import each other in a circle.

Each finder is tested on a hand-written package first, so that a finder that sees nothing cannot pass for a package
that is clean.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_hookdiag


def private_cross_module_imports(package: Path) -> list[str]:
    """``"module:line imports owner._name"`` for every private name a module of ``package`` takes from another one.

    Both ``from lightning_hookdiag.x import _name`` and ``owner._name`` on a module imported as ``owner`` count;
    a module's own private names, and dunders, do not.
    """
    root = package.parent
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__") for p in package.rglob("*.py")
    }
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        here = str(path.relative_to(root))
        aliases: dict[str, str] = {}  # local name -> module of the package it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{here}:{node.lineno} imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{here}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_the_private_import_finder_sees_both_spellings(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "owner.py").write_text("def _helper(): ...\ndef public(): ...\n")
    (package / "user.py").write_text(
        "from pkg.owner import _helper, public\nfrom pkg import owner as o\nfrom pkg import owner\n"
        "o._helper()\nowner.__name__\nowner.public()\n"
    )
    (package / "clean.py").write_text("def _mine(): ...\n_mine()\n")
    assert private_cross_module_imports(package) == [
        "pkg/user.py:1 imports pkg.owner._helper",
        "pkg/user.py:4 uses pkg.owner._helper",
    ]


def test_no_module_takes_a_private_name_from_another():
    found = private_cross_module_imports(Path(lightning_hookdiag.__file__).parent)
    assert not found, "make these helpers public in their owning module:\n" + "\n".join(found)


def package_modules(package: Path) -> dict[str, Path]:
    """``{dotted name: path}`` of every module of ``package``; a package is its ``__init__``."""
    modules: dict[str, Path] = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(path: Path, modules: dict[str, Path], root: str) -> set[str]:
    """The modules of the package ``root`` that the module at ``path`` imports anywhere (``TYPE_CHECKING`` too).

    ``from pkg.sub import name`` is an import of ``pkg.sub.name`` where that is a module, else of ``pkg.sub``.
    """
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(root):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                imported.add(target if target in modules else node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names if a.name.split(".")[0] == root)
    return imported & modules.keys()


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node of ``graph`` (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(components)


def import_cycles(package: Path) -> list[list[str]]:
    """The import cycles among a package's modules, counting every ``import`` statement (``TYPE_CHECKING`` too)."""
    modules = package_modules(package)
    return strongly_connected({name: imported_modules(path, modules, package.name) for name, path in modules.items()})


def test_the_cycle_finder_sees_a_cycle_through_a_type_checking_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import x\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")
    assert import_cycles(package) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_package_has_no_import_cycle():
    # Names live where they belong (ROOT / LOSS / BATCH in names.py, Trip in step_state.py), so that provenance,
    # the rules and the sentinel do not import each other in a circle (issue 30 item 3).
    assert import_cycles(Path(lightning_hookdiag.__file__).parent) == []
