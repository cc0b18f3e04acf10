"""Re-running a kernel test module on the AVX2 code of kernels that pick AVX-512 at run time.

The C++ kernels choose their AVX-512 code once per process (`raytp::use_avx512`, which
RAYTP_CPU_NO_AVX512 turns off), so on an AVX-512 machine the AVX2 code is only reached from a
fresh process with that variable set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# On a CPU without AVX-512 (or with it turned off) a module's own run already is the AVX2 run.
needs_avx512 = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512" or "RAYTP_CPU_NO_AVX512" in os.environ,
    reason="no AVX-512 in use here, so the module's other tests already ran the AVX2 code",
)


def rerun_on_avx2(test_file: str, this_test: str) -> None:
    """Run `test_file`'s tests except `this_test` in a subprocess with RAYTP_CPU_NO_AVX512=1; fail with
    pytest's output if any fails."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", f"not {this_test}"],
        env={**os.environ, "RAYTP_CPU_NO_AVX512": "1"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
