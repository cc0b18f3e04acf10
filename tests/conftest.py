"""Session-wide test setup: end the pytest process without C-level teardown once every result is out.

Why: one CI run on 2026-11-23 passed all 781 tests and then died of SIGSEGV at exit (exit code
139), with no Python stack even under PYTHONFAULTHANDLER=1, so it crashed after Python's own
finalization, in C-level teardown; a local run had done the same the day before. Four other local
full runs did not crash, so there is no core dump to name the culprit. The likely one: Ray 2.60
leaves native threads running in the driver after `ray.shutdown()` (its GCS client's io_service,
gRPC's event-engine and timer threads; after Ray Serve also the core worker's io thread and Serve's
router event-loop thread; seen in /proc/self/task after a plain ray.init() + ray.shutdown()), and the
libraries' C++ static destructors run under them at exit. Ray documents the same class of race for
processes that init and shut down Ray repeatedly (ray-project/ray#31145), as this test process does.

So once pytest has written its summary and every exit function that matters has run, the process
leaves with os._exit and pytest's own exit status. Nothing about a test's result changes: a failing
session still exits non-zero, and a crash during the tests still crashes.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import sys
from pathlib import Path

import pytest

_session: pytest.Session | None = None
# In-process engines leave glibc's malloc as it is (model_exec/malloc_tuning.py): with the tuning, memory each
# of the session's dozens of engines freed stays with this process until the end of the run.
os.environ.setdefault("RAYTP_MALLOC_TUNING", "0")


def pytest_sessionstart(session: pytest.Session) -> None:
    global _session
    _session = session


def _leave_without_teardown() -> None:
    """Registered before Ray is imported, so it runs after Ray's own exit handler (atexit is LIFO)."""
    if _session is None:  # no session started (pytest failed before it): exit as usual
        return
    status = int(_session.exitstatus)  # final: pytest sets it before returning from main()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a test left Ray up: stop its local processes first
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


atexit.register(_leave_without_teardown)


# --- Two lanes (pytest-xdist: `-n 2 --dist loadgroup` in pyproject's addopts) ---------------------------------
# Decision: the suite runs on two xdist workers. Every test that starts Ray, a server or a cluster goes to one
# group, "live", which xdist runs on one worker in collection order, exactly as the serial suite did: two Ray
# clusters or two live servers side by side on a 2-core machine made timing-sensitive tests flaky (and some
# tests scan /proc for processes left behind). Everything else (kernels, model parity in-process or over gloo,
# the scheduler, docs, static checks) is spread over both workers, so it runs beside the live tests' waits
# (Ray and server start-ups, health checks), which leave a core idle.
# Each worker computes on one thread: two processes with two OpenMP threads each on two cores spent their time
# in OpenMP's spin barriers (a validation run crawled: gomp_team_barrier_wait_end under every torch op). Set
# before torch loads, so OpenMP and MKL read it; processes a test starts inherit it, and the Ray ranks set
# their own count (cluster/worker.py). Outside xdist (`-n 0`) nothing changes.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
_LIVE_DIRS = frozenset({"serving", "batch", "k8s", "metrics"})
_LIVE_FILES = frozenset({"test_wheel.py", "test_proc_mem.py", "test_serving_sustained.py"})
_LIVE_HINT = re.compile(r"\bray\b|ray_session|ray_helpers|ray_cluster|raytp_serve|serve_cli|EngineController|\"ray\"")
_TESTS = Path(__file__).resolve().parent


@functools.cache
def _is_live(path: Path) -> bool:
    parts = path.resolve().relative_to(_TESTS).parts
    if parts[0] in _LIVE_DIRS or path.name in _LIVE_FILES:
        return True
    return bool(_LIVE_HINT.search(path.read_text()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_live(Path(item.path)):
            item.add_marker(pytest.mark.xdist_group("live"))
