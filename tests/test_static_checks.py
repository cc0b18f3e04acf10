"""Architecture and hygiene rules from DESIGN.md, checked on every CI run.

- Imports point down: entry points (serve_app, raytp/cli) -> raytp -> cluster -> {scheduler, kv, model_exec} -> ops.
- The control plane imports no torch: the controller, the HTTP ingress and handlers, scheduler/ and kv/.
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
PACKAGES = ("serve_app", "raytp", "cluster", "scheduler", "kv", "model_exec", "ops")
# package -> first-party packages it may import
ALLOWED = {
    "ops": {"ops"},
    "kv": {"kv"},
    "scheduler": {"scheduler", "kv"},
    "model_exec": {"model_exec", "ops", "scheduler"},
    "cluster": {"cluster", "scheduler", "kv", "model_exec", "ops"},
    "raytp": {"raytp", "cluster", "scheduler", "kv", "model_exec", "ops"},
    "serve_app": set(PACKAGES),
}
ENTRY_POINTS = {"raytp/cli"}  # the CLI is an entry point beside serve_app.py: it may deploy it


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
        allowed = ALLOWED[package] | ({"serve_app"} if str(path.parent.relative_to(ROOT)) in ENTRY_POINTS else set())
        bad = _first_party_imports(path) - allowed
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: imports must point down the layers"


CONTROL_PLANE = [
    "scheduler.scheduler",
    "kv",
    "cluster.engine",
    "cluster.controller",
    "cluster.ray_executor",
    "cluster.worker",
    "model_exec.source",
    "raytp",
    "raytp.openai.completions",
    "raytp.openai.chat",
    "raytp.cli.main",
    "serve_app",  # the Serve application as `serve run` names it
    "raytp.serve",  # the HTTP ingress and the model-replica deployment
    "raytp.cli.batch",  # the batch driver and its engine replicas (Ray Data actors)
    "raytp.batch.runner",
    "raytp.batch.replica",
    "raytp.batch.processor",
    "raytp.batch.row_replica",
]


def test_the_control_plane_imports_no_torch() -> None:
    """Issue 7, must-show 2: in a fresh interpreter, importing the controller and the HTTP ingress (and
    everything else that runs outside a model worker) leaves torch out of sys.modules."""
    code = (
        "import importlib, sys\n"
        f"for name in {CONTROL_PLANE!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, f'importing {name} imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_lint_and_types(tool: str) -> None:
    exe = shutil.which(tool, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{tool} is not installed in this environment (it comes with the 'dev' extra)")
    args = [exe, "check", "."] if tool == "ruff" else [exe]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
