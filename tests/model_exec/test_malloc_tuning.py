"""model_exec.malloc_tuning: with glibc told to keep freed memory, a step's big buffers stop page-faulting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A step's pattern: big buffers alive at once, then all freed; prints the fewest minor page faults of
# three more steps after a few (the fewest: one CI run under load saw a single tuned step fault 13 MiB
# afresh, 3,328 faults, not reproduced in 11 runs since; a process whose settings do not work faults in
# every step, so the test still tells the two apart). One buffer is 40 MiB: default glibc maps anything
# over 32 MiB afresh every time, so the untuned run faults for it every step whatever glibc's adaptive
# thresholds have learned. With `tune` the engine's settings come first, and the mmap threshold glibc
# took is printed too.
_SCRIPT = """
import sys, torch
from model_exec import malloc_tuning
threshold = malloc_tuning.keep_freed_memory() if sys.argv[1] == "tune" else 0
def faults():
    return int(open("/proc/self/stat").read().split(")")[1].split()[7])
def step():
    live = []
    for mib in (5, 13, 40, 2, 8, 13, 5):
        live.append(torch.empty(mib << 18))
        live[-1].fill_(1.0)
    del live
for _ in range(3):
    step()
counts = []
for _ in range(3):
    before = faults()
    step()
    counts.append(faults() - before)
print(threshold, min(counts))
"""


def _one_step(mode: str) -> tuple[int, int]:
    """(mmap threshold set, the fewest minor page faults of three steps)."""
    cmd = [sys.executable, "-c", _SCRIPT, mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO, env=dict(os.environ))
    threshold, faults = out.stdout.split()[-2:]
    return int(threshold), int(faults)


def test_a_freed_buffer_comes_back_without_page_faults() -> None:
    if not (sys.platform.startswith("linux") and os.path.exists("/proc/self/stat")):
        pytest.skip("glibc malloc and /proc are Linux's")
    _, untuned = _one_step("plain")
    threshold, tuned = _one_step("tune")
    if threshold == 0:
        pytest.skip("this libc is not glibc, or refused the settings")
    assert untuned > 10240 // 2  # the 40 MiB buffer alone: 10,240 pages, a fault per page (or per 2)
    if threshold < 40 << 20:
        pytest.skip("this glibc keeps its mmap threshold at 32 MiB: the 40 MiB buffer is mapped afresh anyway")
    assert tuned < 100
