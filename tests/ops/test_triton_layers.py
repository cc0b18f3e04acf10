"""The Triton layer kernels (ops/triton_layers.py) equal the unfused ops in float32, float16 and bfloat16, and
the tiny Llama and Qwen2 give the same logits with them in every layer, all through Triton's interpreter.

The interpreter is chosen when triton first loads, and this pytest process may have loaded it already, so
the cases run in one child process (tests/ops/triton_layers_check.py) whose JSON answer each test reads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops import fused_cuda
from tests.ops.triton_layers_check import CASES

ROOT = Path(__file__).resolve().parents[2]
NEEDS_TRITON = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (the `test` extra installs it)"
)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ops.triton_layers_check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"the interpreter run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    results: dict[str, str | None] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


@NEEDS_TRITON
@pytest.mark.parametrize("case_id", CASES)
def test_kernels_match_the_unfused_ops(interpreter_results: dict[str, str | None], case_id: str) -> None:
    assert case_id in interpreter_results, f"the interpreter run reported no result for {case_id}"
    failure = interpreter_results[case_id]
    assert failure is None, failure


def test_the_gate_takes_cuda_tensors_only() -> None:
    x = torch.zeros(2, 8)
    assert not fused_cuda.applies(x), "CPU tensors keep the CPU kernels or torch"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        if os.environ.get("TRITON_INTERPRET") != "1":
            fused_cuda.interpret_on_cpu()
        else:
            raise RuntimeError("TRITON_INTERPRET is set in this process: nothing to check")
