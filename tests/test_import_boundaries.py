"""The seam between the platform and its learners (docs/architecture.md).

`services/` and `learner/` meet only in `contract/`: neither imports the other (the
platform starts learners by module name, e.g. `python -m learner.controller`, which is a
string, not an import), and `contract/` imports neither. Every module's import statements
are read from its syntax tree, so the check is fast and sees imports inside functions too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("services", "learner", "contract")
# What each package may not import.
FORBIDDEN = {
    "services": ("learner",),
    "learner": ("services",),
    "contract": ("services", "learner"),
}


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import statement of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                yield node.lineno, ".".join([*base, node.module or ""]).rstrip(".")
            else:
                yield node.lineno, node.module or ""


def _crossings(package: str) -> list[str]:
    out = []
    for path in _modules(package):
        for line, name in _imports(path):
            top = name.split(".", 1)[0]
            if top in FORBIDDEN[package]:
                out.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return out


@pytest.mark.parametrize("package", SIDES)
def test_no_import_crosses_the_seam(package: str) -> None:
    assert _modules(package), f"no modules under {package}/"
    crossings = _crossings(package)
    allowed = "contract" if package != "contract" else "the standard library and third parties"
    assert not crossings, f"{package}/ may import only {allowed} across the seam:\n" + "\n".join(
        crossings
    )


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    source = "def f():\n    from learner.controller import controller\n"
    tree = ast.parse(source)
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names == ["learner.controller"]
