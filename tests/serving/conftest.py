"""Fixtures the serving modules share.

A live server costs a Ray, a Serve application and an engine (20-40 s on CI's two cores), so modules that
need the same plain server share one (`shared_live_server`), and modules that need the same offline
reference engine share one (`small_engine_llm`). What each may NOT be used for is in its docstring.
tests/conftest.py makes every module that asks for either one work unit, run in one process one module after
another, so each starts once: any other live server in between would end the shared one (one Ray per process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.serving.live_server import SMALL_ENGINE, LiveServer, shared_server, stop_shared_server


@pytest.fixture(scope="module")
def shared_live_server() -> LiveServer:
    """The SMALL_ENGINE server shared by the modules that ask for it (see `shared_server` for what it may NOT
    be used for: anything that changes the server, its engine, its adapters or its flags)."""
    return shared_server()


@pytest.fixture(scope="package", autouse=True)
def _stop_the_shared_server_after_serving() -> Iterator[None]:
    yield
    stop_shared_server()


@pytest.fixture(scope="package")
def small_engine_llm() -> Iterator[Any]:
    """The offline reference engine, in this process (in-process executor, TP=1), on SMALL_ENGINE: what a
    SMALL_ENGINE server must answer. Read-only: NOT for a test that adds LoRA adapters, changes its config,
    shuts it down or leaves requests in it (it serves every serving module that compares with it)."""
    from raytp import LLM

    llm = LLM(None, **SMALL_ENGINE)
    yield llm
    llm.llm_engine.shutdown()
