"""Numbers read from the environment (RAYTP_* settings), with a clear error naming a malformed one. Imports
nothing heavy: the engine's config reads it where neither Ray nor torch may be loaded."""

from __future__ import annotations

import os


def env_float(name: str, default: float) -> float:
    """A positive number from the environment, with a clear error for a malformed one."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value
