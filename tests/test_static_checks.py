"""Architecture and hygiene rules from DESIGN.md, checked on every CI run.

- Imports point down the layers: tests/test_layers.py.
- The control plane imports no torch: the controller, the HTTP ingress and handlers, scheduler/, kv/ and request/.
- ruff and mypy pass with the settings in pyproject.toml.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONTROL_PLANE = [
    "scheduler.scheduler",
    "kv",
    "request",
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
    "raytp.serve.app",  # the HTTP ingress and the model-replica deployment
    "raytp.openai.routes",  # the route table and every handler
    "raytp.batch.input",  # batch validation (the route table's urls)
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
