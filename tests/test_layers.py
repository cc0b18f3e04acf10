"""Imports point down the layers (DESIGN.md), checked on every file of every first-party package:

    serve_app.py -> raytp -> cluster -> model_exec -> scheduler -> kv -> ops -> request

A module may import its own layer or any below it, never one above. Imports under `if TYPE_CHECKING:`
are exempt (they never run); imports inside functions count (they run when called). Parsed with `ast`,
nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("serve_app", "raytp", "cluster", "model_exec", "scheduler", "kv", "ops", "request")  # top first
RANK = {name: i for i, name in enumerate(LAYERS)}


def layer_files() -> list[Path]:
    files = [ROOT / "serve_app.py"]
    for package in LAYERS[1:]:
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """(line, first-party top-level package) of every import that runs."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:  # `else:` of a TYPE_CHECKING block does run
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(node.lineno, a.name.split(".")[0]) for a in node.names if a.name.split(".")[0] in RANK]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        # A relative import stays inside its own package: its own layer.
        if node.level == 0 and node.module and node.module.split(".")[0] in RANK:
            self.found.append((node.lineno, node.module.split(".")[0]))


def upward_imports(path: Path) -> list[str]:
    """`file:line imports layer` for each import of a layer above the file's own."""
    rel = path.relative_to(ROOT)
    own = "serve_app" if rel == Path("serve_app.py") else rel.parts[0]
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    return [f"{rel}:{line} imports {layer}" for line, layer in visitor.found if RANK[layer] < RANK[own]]


@pytest.mark.parametrize("path", layer_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_layer_above_its_own(path: Path) -> None:
    bad = upward_imports(path)
    assert not bad, "imports must point down the layers (DESIGN.md):\n" + "\n".join(bad)


def test_the_check_sees_what_it_must(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The visitor itself: a module-level, an in-function and a TYPE_CHECKING-else import are found;
    one under TYPE_CHECKING and a relative one are not."""
    pkg = tmp_path / "kv"
    pkg.mkdir()
    src = pkg / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import scheduler.x\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from cluster import y\n"
        "else:\n"
        "    import raytp\n"
        "def f():\n"
        "    from model_exec import z\n"
        "from ops import fine\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert upward_imports(src) == [
        "kv/m.py:2 imports scheduler",
        "kv/m.py:7 imports raytp",
        "kv/m.py:9 imports model_exec",
    ]
