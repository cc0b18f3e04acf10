"""Free TCP ports for servers the tests start, chosen where Ray will not take them first.

A port the kernel hands out for `bind(("127.0.0.1", 0))` comes from the ephemeral range (here
32768-60999), which is where every process a fresh Ray cluster starts binds its own gRPC and
metrics ports. Between picking such a port and the server binding it, one of them can take it:
seen in CI as Serve's proxy failing with "Failed to bind to address '127.0.0.1:34129'". So ports come
from between Ray's default worker ports (10002-19999) and the ephemeral range, probed with a bind.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOW = 20000  # above Ray's default worker ports (--min/--max-worker-port 10002-19999)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, outside the ranges Ray's processes bind."""
    high = max(_LOW + 1000, _ephemeral_low() - 1)
    for _ in range(200):
        port = random.randint(_LOW, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {_LOW} and {high}")
