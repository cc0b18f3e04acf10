"""Architecture and hygiene rules from DESIGN.md, checked on every CI run.

- Imports point down: serve_app -> cluster -> {scheduler, kv, model_exec} -> ops.
- scheduler/ and kv/ (apart from the cache engine, which holds the tensors) import no torch.
- ruff and mypy pass with the settings in pyproject.toml.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("serve_app", "cluster", "scheduler", "kv", "model_exec", "ops")
# package -> first-party packages it may import
ALLOWED = {
    "ops": {"ops"},
    "kv": {"kv", "ops"},
    "scheduler": {"scheduler", "kv"},
    "model_exec": {"model_exec", "ops", "scheduler"},
    "cluster": {"cluster", "scheduler", "kv", "model_exec", "ops"},
    "serve_app": set(PACKAGES),
}


def _first_party_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return found


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "serve_app"])
def test_imports_point_down(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _first_party_imports(path) - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: imports must point down the layers"


def test_scheduler_and_kv_import_no_torch() -> None:
    code = "import sys, scheduler, scheduler.scheduler, kv; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_lint_and_types(tool: str) -> None:
    exe = shutil.which(tool, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{tool} is not installed in this environment (it comes with the 'dev' extra)")
    args = [exe, "check", "."] if tool == "ruff" else [exe]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
