"""Serve's mode as `raytp serve` runs it, for the Ray a test starts, and only for that Ray."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from raytp.serve.args import SERVE_ENV_DEFAULTS


@contextmanager
def serve_defaults() -> Iterator[None]:
    """SERVE_ENV_DEFAULTS while the block starts its Ray (every Ray process inherits the variables then),
    and this process's environment as it was afterwards: otherwise the mode leaks into every later test
    module's Ray, and what a module tests depends on which modules ran before it."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in SERVE_ENV_DEFAULTS.items():
            env.setenv(name, os.environ.get(name, value))  # as `use_serve_defaults`: a value already set wins
        yield
