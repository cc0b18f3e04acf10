"""Fixtures shared by the family parity tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray


@pytest.fixture(scope="package")
def ray_session() -> Iterator[None]:
    """One local Ray for every family's TP=2 engine test (starting one costs ~10 s on 2 cores); the modules that
    ask for it are one work unit (tests/conftest.py), run one after another in one process.

    NOT for a test that shuts Ray down, kills its nodes, starts a Ray of its own, or needs other resources
    than its 4 logical CPUs: every family module after it would find Ray gone or changed. A test must end
    its engine (and so free its workers' bundles) before it returns."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
