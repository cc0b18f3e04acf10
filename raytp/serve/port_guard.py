"""Before `raytp serve` starts Ray: is its API port free, and if an earlier server's HAProxy holds it, free it.

HAProxy started by a Ray 2.60 Serve outlived a server that was killed (its parent actor died, it was
re-parented) and kept answering on the API port with 500s; the next `raytp serve` on that port then
failed deep inside Serve's startup. raytp's own HAProxy now dies with its parent (haproxy_shim.py), but a
leftover from before that, or from a cluster started another way, is still possible. So the port is
checked up front (Linux /proc, this user's processes):
- held by an HAProxy whose parent is no Ray actor: a leftover; it is stopped, and the reason printed;
- held by anything else: a PortInUseError (exit 2) naming the process, before Ray starts.
Decision: any listener on the port counts, whatever its address: HAProxy binds with SO_REUSEADDR only,
and a wildcard and a specific address on one port refuse each other.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


class PortInUseError(ValueError):
    """The API port is held by a process raytp must not stop (ValueError: the CLI's exit 2)."""


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[str]:
    """Socket inodes listening on `port` on any address (IPv4 and IPv6)."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        with contextlib.suppress(OSError):
            for row in (proc / table).read_text().splitlines()[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def holders(inodes: set[str], proc: Path = Path("/proc")) -> list[int]:
    """The pids (of those this user may inspect) with one of these sockets open."""
    wanted = {f"socket:[{i}]" for i in inodes}
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in wanted for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def _parent(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after its ')'.
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def is_leftover_haproxy(pid: int) -> bool:
    """An HAProxy whose parent is not a Ray actor (Ray titles actor processes `ray::ClassName`): the
    HAProxyManager that owned it is gone, and nothing will ever stop or reconfigure it."""
    argv = _cmdline(pid)
    if not argv or os.path.basename(argv[0]) != "haproxy":
        return False
    with contextlib.suppress(OSError, ValueError, IndexError):
        return not _cmdline(_parent(pid))[0].startswith("ray::")
    return False


def claim_port(port: int, log: Callable[[str], None] = print) -> None:
    """Make sure nothing listens on `port`: stop leftover HAProxies, refuse for anything else."""
    inodes = listening_inodes(port)
    if not inodes:
        return
    pids = holders(inodes)
    if not pids:
        raise PortInUseError(f"port {port} is in use by a process of another user; choose another --port")
    for pid in pids:
        if not is_leftover_haproxy(pid):
            cmd = " ".join(_cmdline(pid))[:200] or "?"
            raise PortInUseError(f"port {port} is in use by pid {pid} ({cmd}); stop it or choose another --port")
    for pid in pids:
        log(f"raytp: stopping pid {pid}, an HAProxy left by an earlier server on port {port}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while listening_inodes(port):
        if time.monotonic() > deadline:
            raise PortInUseError(f"port {port} is still in use after stopping the leftover HAProxy {pids}")
        time.sleep(0.1)
