"""Serve's mode as `raytp serve` runs it, for the Ray a test starts, and only for that Ray."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from serve_app import SERVE_ENV_DEFAULTS, use_serve_defaults


@contextmanager
def serve_defaults() -> Iterator[None]:
    """`use_serve_defaults()` while the block starts its Ray (every Ray process inherits the variables
    then), and this process's environment as it was afterwards: otherwise the mode leaks into every later
    test module's Ray, and what a module tests depends on which modules ran before it."""
    before = {name: os.environ.get(name) for name in SERVE_ENV_DEFAULTS}
    use_serve_defaults()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
