"""A local Ray per test module whose metrics reach the node's metrics port within ~1 s."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from raytp.serve.haproxy_env import release
from tests.helpers.serve_env import serve_defaults
from tests.metrics.prom import free_port

# Ray exports every 10 s by default (RAY_metrics_report_interval_ms); 1 s keeps the waits short.
EXPORT_INTERVAL_MS = 1000


@pytest.fixture(scope="module")
def ray_metrics_port() -> Iterator[int]:
    """A fresh local Ray (never a cluster someone else started) and its node's metrics port, one per module.

    NOT for a test that shuts Ray down or restarts it (the module's later tests would lose it), nor for reading a
    series absolutely that an earlier test of the module also moved (take a before/after difference)."""
    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    with serve_defaults() as haproxy_dir:  # the Serve metrics as `raytp serve` produces them
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _metrics_export_port=port,
            _system_config={"metrics_report_interval_ms": EXPORT_INTERVAL_MS},
        )
    yield port
    ray.shutdown()
    release(haproxy_dir)
