"""The package's modules talk to each other through public names only: a helper that two modules need is public in
the module that owns its job (issue 22), so that a module's private names can change without breaking another one.

The finder is tested on a hand-written package first, so that a finder that sees nothing cannot pass for a package
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
