"""Fixtures shared by the family parity tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray


@pytest.fixture(scope="package")
def ray_session() -> Iterator[None]:
    """One local Ray for every family's TP=2 engine test (starting one costs ~10 s on 2 cores)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
