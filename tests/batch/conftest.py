"""Fixtures of the batch tests that run engines. Module-scoped: each test module gets its own tiny model and
its own local Ray (8 logical CPUs: each engine replica's worker holds a 1-CPU bundle, and Ray Data's read tasks
take CPUs of their own), so one module's leftovers never starve the next."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from tests.helpers.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray of this module's own; its GCS address.

    NOT for a test that shuts Ray down or leaves actors or jobs running: the module's later tests run on it."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
