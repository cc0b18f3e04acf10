"""Serve's mode as `raytp serve` runs it, for the Ray a test starts, and only for that Ray."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from raytp.serve.args import SERVE_ENV_DEFAULTS
from raytp.serve.haproxy_env import (
    FALLBACK_PORT_ENV,
    free_port,
    make_server_dir,
    private_haproxy_env,
    real_haproxy_binary,
)


@contextmanager
def serve_defaults() -> Iterator[Path]:
    """SERVE_ENV_DEFAULTS while the block starts its Ray (every Ray process inherits the variables then),
    and this process's environment as it was afterwards: otherwise the mode leaks into every later test
    module's Ray, and what a module tests depends on which modules ran before it.

    HAProxy runs as `raytp serve` runs it (raytp/serve/haproxy_env.py): its config in a private directory,
    no stats page or exporter on Ray's fixed ports 8404/9101, the fallback proxy on a free port. So two test
    servers (two test runs, or a test beside a `raytp serve`) never collide on a port. Yields that directory:
    remove it (`raytp.serve.haproxy_env.release`) once the block's Ray is shut down."""
    directory = make_server_dir()
    with pytest.MonkeyPatch.context() as env:
        for name, value in SERVE_ENV_DEFAULTS.items():
            env.setenv(name, os.environ.get(name, value))  # as `use_serve_defaults`: a value already set wins
        for name, value in private_haproxy_env(directory, real_haproxy_binary()).items():
            env.setenv(name, value)
        env.setenv(FALLBACK_PORT_ENV, str(free_port("127.0.0.1")))
        yield directory
