"""The HAProxy binary that Ray Serve runs for `raytp serve`: it narrows Ray's config, then becomes HAProxy.

Ray Serve 2.60 starts HAProxy as `BINARY -db -f CONFIG ...` from its HAProxyManager actor, with
RAY_SERVE_HAPROXY_BINARY_PATH as its one hook for which binary (`raytp/cli/haproxy_env.py` points it
at a launcher that runs this file: `python -I haproxy_shim.py REAL_HAPROXY ARGS...`). Run standalone,
so it imports only the standard library.

Decisions:
- HAProxy dies with the actor that started it (PR_SET_PDEATHSIG: SIGKILL). Ray kills that actor
  without its `shutdown()` when the cluster goes (`ray.shutdown()`, a crash, SIGKILL), and HAProxy
  used to live on, re-parented to 1, holding the API port and answering every request with a 500.
- Ray 2.60 renders a `listen stats` page and a `frontend prometheus` exporter bound to every interface
  (`bind *:8404`, `bind :9101`, ports fixed, no auth, no host knob) and the admin socket `mode 666`.
  Nothing in Ray reads those two ports (its manager talks to the admin socket), so both sections go and
  the socket becomes `mode 600`: HAProxy then listens on the API port alone, on the address `--host`
  names, and two servers on one host no longer fight over 8404/9101.
- The config is rewritten in place (Ray writes it anew before every start or reload) and the real
  binary replaces this process (`execv`: same pid), so Ray's pid checks on the admin socket and its
  `/proc/PID/cmdline` match on the config path keep working.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

# Top-level config sections (a line at column 0) that Ray 2.60 renders and raytp drops.
DROPPED_SECTIONS = frozenset({"listen stats", "frontend prometheus"})
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def narrow_config(text: str) -> str:
    """Ray's HAProxy config without the stats page and Prometheus exporter, admin socket owner-only.

    Idempotent: Ray rewrites the file before each spawn, but a spawn that finds it already narrowed
    leaves it as it is.
    """
    kept: list[str] = []
    dropping = False
    for line in text.splitlines(keepends=True):
        if line[:1] not in ("", " ", "\t", "\n", "#"):  # a new top-level section starts here
            dropping = line.strip() in DROPPED_SECTIONS
        if dropping:
            continue
        if line.lstrip().startswith("stats socket "):
            line = line.replace(" mode 666 ", " mode 600 ")
        kept.append(line)
    return "".join(kept)


def _config_path(args: list[str]) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg == "-f":
            return args[i + 1]
    return None


def _die_with_parent() -> None:
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the signal was armed: nobody would stop us
        sys.exit("haproxy_shim: the process that started HAProxy is gone")


def _rewrite(path: str) -> None:
    with open(path) as f:
        text = f.read()
    narrowed = narrow_config(text)
    if narrowed != text:
        tmp = f"{path}.raytp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(narrowed)
        os.replace(tmp, path)  # HAProxy never reads a half-written file


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: haproxy_shim.py REAL_HAPROXY [HAPROXY ARGS...]")
    real, args = argv[1], argv[2:]
    _die_with_parent()
    config = _config_path(args)
    if config is not None:
        _rewrite(config)
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv)
