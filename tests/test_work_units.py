"""The suite's xdist work units (tests/conftest.py) hold, for the tests this session collected.

A module split over two workers sets its module fixtures (servers, Rays, engines) up on each, and modules that
share a cross-module fixture must run in one process one after another, so it starts once.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import work_units


def _unit(item: pytest.Item) -> str:
    (unit,) = {mark.args[0] for mark in item.iter_markers("xdist_group")}
    return str(unit)


def test_each_module_is_in_one_unit_and_each_unit_runs_in_one_stretch(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    by_module: dict[str, str] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], _unit(item))
        assert by_module[item.nodeid.split("::")[0]] == _unit(item), item.nodeid
    stretches = [u for n, u in enumerate(map(_unit, items)) if n == 0 or u != _unit(items[n - 1])]
    assert len(stretches) == len(set(stretches)), "a unit's tests must be next to each other"
    if os.environ.get("PYTEST_XDIST_WORKER") and getattr(request.config.option, "loadgroup", False):
        # What xdist's scheduler reads: without the suffix every test is a unit of its own.
        assert all(item.nodeid.endswith("@" + _unit(item)) for item in items)


def test_modules_sharing_a_server_or_a_package_fixture_are_one_unit(request: pytest.FixtureRequest) -> None:
    units = work_units(request.session.items)
    shared = [m for m in units if m.startswith("tests/serving/") and m.rsplit("/", 1)[1] in _SHARED_SERVER]
    assert len({units[m] for m in shared}) <= 1, {m: units[m] for m in shared}
    families = [m for m in units if m.rsplit("/", 1)[1] in _FAMILIES_ON_RAY]
    assert len({units[m] for m in families}) <= 1, {m: units[m] for m in families}


def test_modules_on_the_shared_server_run_one_after_another(request: pytest.FixtureRequest) -> None:
    """No module of its unit runs between two modules on `shared_live_server`: one with a server of its own
    (test_tensor_parallel.py) would end the shared one, and the next module would start it again."""
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in request.session.items))
    on_shared = {
        item.nodeid.split("::")[0]
        for item in request.session.items
        if "shared_live_server" in getattr(item, "fixturenames", ())
    }
    at = [n for n, m in enumerate(modules) if m in on_shared]
    assert not at or at == list(range(at[0], at[0] + len(at))), modules[at[0] : at[-1] + 1] if at else modules


# Modules on `shared_live_server` / `small_engine_llm`, and the family modules on the package `ray_session`.
# (test_tensor_parallel.py left them when its TP=3 check moved to the dequantized weights, with its own engine.)
_SHARED_SERVER = {"test_openai_api.py", "test_structured_live.py", "test_tool_calls_live.py"}
_FAMILIES_ON_RAY = {"test_mixtral.py", "test_qwen2_moe.py", "test_qwen3_moe.py"}
