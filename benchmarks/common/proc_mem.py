"""Peak memory of a process tree, sampled from /proc (Linux) on a background thread.

An engine is several processes (vLLM: API server + EngineCore; raytp serve: driver, Ray's GCS and
raylet, the Serve proxy, controller and worker actors), so a tree is summed per sample and the peak
of those sums is kept. Two sums: RSS (what the issue's table asks for; it counts a shared library or
a shared-memory page once per process that maps it) and PSS (each shared page split among its
sharers, so the processes' PSS add up to the memory they really hold). `engine_only` keeps the root
and Ray's worker processes (`ray::...`: actors and Serve replicas) and drops Ray's own daemons.

Sampling must not slow what it measures. RSS comes from `/proc/PID/statm` (a counter: ~15 us).
PSS needs `/proc/PID/smaps_rollup`, which walks every mapping of the process under its mmap lock:
~50 ms of kernel time for a 5 GiB process on the 2-core machines here, while a munmap in that
process (torch frees large activations that way) waits for the walk. Read every 0.5 s, as this
module once did, that took ~10% of a core per sampled engine, on the CPU the engines compute on.
So PSS is read only when the tree's RSS has grown by `PSS_STEP` since the last PSS read (which
tracks the peak, since PSS <= RSS and both grow together) and otherwise every `PSS_INTERVAL_S`.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_KIB = 1024
_PAGE = os.sysconf("SC_PAGE_SIZE")
PSS_STEP = 64 << 20  # bytes of RSS growth that trigger a PSS read
PSS_INTERVAL_S = 30.0  # and a PSS read at least this often


@dataclass(frozen=True)
class MemPeak:
    rss_bytes: int  # peak over samples of the summed VmRSS of the tree
    pss_bytes: int  # peak over samples of the summed Pss of the tree
    processes: int  # processes in the tree at the sample with the peak RSS

    def describe(self) -> str:
        gib = 1 << 30
        return f"peak RSS {self.rss_bytes / gib:.2f} GiB, PSS {self.pss_bytes / gib:.2f} GiB ({self.processes} proc)"


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # The command name sits in parentheses and may itself hold spaces or ')': split after the last ')'.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def tree(root: int, skip: frozenset[int] = frozenset()) -> list[int]:
    """`root` and every descendant alive now, leaving out the subtrees rooted at `skip`."""
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in skip:
            continue
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _is_ray_worker(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::")
    except OSError:
        return False


def _rss(pid: int) -> int:
    """Resident bytes of one process (statm's second field, in pages); 0 once it has exited."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _pss(pid: int) -> int:
    """Proportional set size of one process in bytes; 0 once it has exited. Costly: see the module doc."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * _KIB
    except (OSError, ValueError):
        pass
    return 0


class PeakSampler:
    """Samples the tree under `root` every `interval_s` until stop(); `peak` is the running maximum.

    `skip` names children that belong to someone else (the benchmark's vLLM driver under the process
    that also runs raytp in-process); it may grow while sampling runs.
    """

    def __init__(self, root: int, interval_s: float = 0.5, engine_only: bool = False) -> None:
        self.root = root
        self.interval_s = interval_s
        self.engine_only = engine_only
        self.skip: set[int] = set()
        self._rss = self._pss = self._procs = 0
        self._pss_at_rss = -PSS_STEP  # the tree's RSS when PSS was last read: the first sample reads it
        self._pss_at = 0.0  # time.monotonic() of that read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mem-{root}", daemon=True)

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def stop(self) -> MemPeak:
        self._stop.set()
        self._thread.join()
        return self.peak

    @property
    def peak(self) -> MemPeak:
        return MemPeak(self._rss, self._pss, self._procs)

    def sample(self) -> None:
        pids = tree(self.root, frozenset(self.skip))
        if self.engine_only:
            pids = [p for p in pids if p == self.root or _is_ray_worker(p)]
        rss = sum(_rss(p) for p in pids)
        if rss > self._rss:
            self._rss, self._procs = rss, len(pids)
        now = time.monotonic()
        if rss >= self._pss_at_rss + PSS_STEP or now - self._pss_at >= PSS_INTERVAL_S:
            self._pss = max(self._pss, sum(_pss(p) for p in pids))
            self._pss_at_rss, self._pss_at = rss, now

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)


if __name__ == "__main__":
    s = PeakSampler(os.getpid())
    s.sample()
    print(s.peak.describe())
