"""A child Python that behaves as on a bare GPU box: Ray, gguf and llguidance cannot be imported there.

`run_bare(code)` runs `code` in a fresh interpreter from the repository root (PYTHONPATH first), after a
meta-path finder that raises ImportError for every module under those packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("ray", "gguf", "llguidance")  # not installed on the GPU box (torch, triton, transformers are)

_PRELUDE = f"""
import importlib.abc, sys

class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ImportError(f"{{name}} is not installed here (refused by the test)")
        return None

sys.meta_path.insert(0, _Refuse())
"""


def run_bare(code: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
