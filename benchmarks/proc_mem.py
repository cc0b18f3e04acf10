"""Peak memory of a process tree, sampled from /proc (Linux) on a background thread.

An engine is several processes (vLLM: API server + EngineCore; raytp serve: driver, Ray's GCS and
raylet, the Serve proxy, controller and worker actors), so a tree is summed per sample and the peak
of those sums is kept. Two sums: RSS (what the issue's table asks for; it counts a shared library or
a shared-memory page once per process that maps it) and PSS (each shared page split among its
sharers, so the processes' PSS add up to the memory they really hold). `engine_only` keeps the root
and Ray's worker processes (`ray::...`: actors and Serve replicas) and drops Ray's own daemons.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

_KIB = 1024


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


def _rollup(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in bytes; (0, 0) once it has exited."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * _KIB
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * _KIB
    except (OSError, ValueError):
        pass
    return rss, pss


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
        sums = [_rollup(p) for p in pids]
        rss, pss = sum(r for r, _ in sums), sum(p for _, p in sums)
        if rss > self._rss:
            self._rss, self._procs = rss, len(pids)
        self._pss = max(self._pss, pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)


if __name__ == "__main__":
    s = PeakSampler(os.getpid())
    s.sample()
    print(s.peak.describe())
