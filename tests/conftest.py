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
import os
import sys

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
