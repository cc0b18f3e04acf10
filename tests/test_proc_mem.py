"""benchmarks/common/proc_mem.py: the peak memory the comparison benchmarks report for each engine's process tree."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.common.proc_mem import PeakSampler, tree

# A child that touches 200 MiB (one write per page, so every page is resident), says so, then waits.
_HOLD = (
    "import time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
    "print('ok', flush=True); time.sleep(60)"
)


def test_peak_sampler_counts_a_childs_memory_and_skips_subtrees_it_is_told_to() -> None:
    with subprocess.Popen([sys.executable, "-c", _HOLD], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ok"
            sampler = PeakSampler(child.pid)
            sampler.sample()
            peak = sampler.peak
            assert peak.rss_bytes >= 200 << 20, peak
            assert 0 < peak.pss_bytes <= peak.rss_bytes, peak  # PSS splits shared pages: never above RSS
            assert peak.processes == 1
            assert child.pid in tree(child.pid) and child.pid not in tree(child.pid, frozenset({child.pid}))
        finally:
            child.kill()
