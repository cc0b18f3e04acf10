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
from _pytest.nodeid import coerce_node_id

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


# --- Work units for two xdist workers (`-n 2 --dist loadgroup --no-loadscope-reorder` in pyproject's addopts) ---
# Decision: xdist hands out whole work units, never single tests. A unit is a test module, joined with every
# other module that shares a package- or session-scoped fixture with it (the serving modules on
# `shared_live_server` and `small_engine_llm`, the family modules on their package `ray_session`). So each
# module-scoped server, Ray or engine starts once, and a cross-module fixture once, in one worker. Split across
# workers, a module set its fixtures up on each: the last CI runs set up tests/metrics/test_serve_live.py's
# server and Prometheus twice (50 s and 45 s), and each worker started the shared server, more than once.
# Autouse package fixtures (teardown hooks) join nothing, or every module of their package would be one unit.
# The two workers run units side by side, so two Rays or live servers may run at once: each test starts its own
# local Ray on free ports (never a fixed one) and counts only processes carrying its own marker, so none sees
# the other's (as before, when xdist spread single tests). Units that start Ray, a server or a cluster run first
# (after `_LONG_FIRST`), in collection order: they are the longest, and the many short in-process units after
# them fill both workers to the end (xdist hands a worker its next unit when it is done with one).
# xdist 3.8 forms units from a `@group` suffix of each test's node id, which its own hook writes from the
# xdist_group marks into `item._nodeid`; pytest 9 reads the node id from `item._id`, so that write is lost and
# every test was its own unit, whatever the marks said (the `live` group of before never took effect). This hook
# therefore writes the suffix itself, first (tryfirst), and only in an xdist worker of `--dist loadgroup`.

# Every engine a test starts without a KV budget gets 1 GiB (RAYTP_CPU_KVCACHE_SPACE; Ray ranks and servers the tests
# start inherit it), not the default quarter of RAM up to 4 GiB: the pool is populated at start, and on the CI's
# machines 4 GiB took 5-6 s where 1 GiB took 0.13 s (Linux compacting fragmented memory for huge pages). 1 GiB
# holds ~23k tokens of SmolLM2; a test about the default's size unsets it (tests/cluster/test_device.py).
os.environ.setdefault("RAYTP_CPU_KVCACHE_SPACE", "1")

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
# Module-scoped fixtures that hand out one object per process across modules (so they join modules as a package
# fixture does): `shared_live_server` returns live_server.py's process-wide server, restarting it if it ended.
_CROSS_MODULE = frozenset({"shared_live_server"})
# Units of a minute or more that stand alone (ruff + mypy on an empty cache; a wheel built and installed in a
# fresh venv): started before all others, so neither is the run's tail with the other worker idle.
_LONG_FIRST = frozenset({"tests/test_static_checks.py", "tests/test_wheel.py"})


@functools.cache
def _is_live(path: Path) -> bool:
    """Whether a module may start Ray, a server or a cluster (its unit then runs among the first)."""
    parts = path.resolve().relative_to(_TESTS).parts
    if parts[0] in _LIVE_DIRS or path.name in _LIVE_FILES:
        return True
    return bool(_LIVE_HINT.search(path.read_text()))


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The package- or session-scoped fixtures of this suite's conftests that `item` asks for (not autouse ones;
    not pytest's or plugins' own, such as `tmp_path_factory`), each named by where it is defined."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    used = {name for mark in item.iter_markers("usefixtures") for name in mark.args}
    autouse = set(info.initialnames) - set(info.argnames) - used
    shared = []
    for name in item.fixturenames:  # type: ignore[attr-defined]
        defs = info.name2fixturedefs.get(name)
        cross = name in _CROSS_MODULE or defs and defs[-1].scope in ("package", "session")
        if defs and defs[-1].baseid and cross and name not in autouse:
            shared.append(f"{defs[-1].baseid}::{name}")
    return shared


def work_units(items: list[pytest.Item]) -> dict[str, str]:
    """module path -> its unit's name (the first of its modules, in collection order)."""
    parent: dict[str, str] = {}
    seen: dict[str, int] = {}  # key -> when first seen: a unit is named by its earliest key

    def find(key: str) -> str:
        seen.setdefault(key, len(seen))
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for item in items:
        module = item.nodeid.split("::")[0]
        find(module)
        for fixture in _shared_fixtures(item):
            a, b = sorted((find(module), find(fixture)), key=seen.__getitem__)
            parent[b] = a
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    return {module: find(module) for module in modules}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each unit's tests next to each other (at its first test's place): the long standalone units, then the
    live ones, then the rest; every test marked with its unit's xdist group. Within a unit, the modules on a
    `_CROSS_MODULE` fixture (the shared server) come first, then the others, each group in collection order, so
    its modules stay whole and the shared server starts once."""
    units = work_units(items)
    first: dict[str, int] = {}
    live: dict[str, bool] = {}
    on_shared: set[str] = set()  # modules that ask for a `_CROSS_MODULE` fixture
    for n, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        unit = units[module]
        first.setdefault(unit, n)
        live[unit] = live.get(unit, False) or _is_live(Path(item.path))
        if _CROSS_MODULE & set(getattr(item, "fixturenames", ())):
            on_shared.add(module)
    position = {id(item): n for n, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int, bool, int]:
        module = item.nodeid.split("::")[0]
        unit = units[module]
        rank = 0 if unit in _LONG_FIRST else 1 if live[unit] else 2
        # Within a unit, the modules on the shared server first, one after another: a module with a server of its
        # own between two of them (test_tensor_parallel.py sorts between test_structured_live.py and
        # test_tool_calls_live.py) ends the shared server, and the next one started it again (a whole SmolLM2
        # server start, 75-90 s on the shared machine, once per run).
        return (rank, first[unit], module not in on_shared, position[id(item)])

    items.sort(key=key)
    suffix = bool(os.environ.get("PYTEST_XDIST_WORKER")) and bool(getattr(config.option, "loadgroup", False))
    for item in items:
        unit = units[item.nodeid.split("::")[0]]
        item.add_marker(pytest.mark.xdist_group(unit))
        if suffix:
            item._id = coerce_node_id(f"{item.nodeid}@{unit}")  # what xdist's scheduler splits units by
