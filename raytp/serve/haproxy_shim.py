"""The HAProxy binary that Ray Serve runs for `raytp serve`: it narrows Ray's config, then becomes HAProxy.

Ray Serve 2.60 starts HAProxy as `BINARY -db -f CONFIG ...` from its HAProxyManager actor, with
RAY_SERVE_HAPROXY_BINARY_PATH as its one hook for which binary (`raytp/serve/haproxy_env.py` points it
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
- HAProxy's own answers come from errorfiles that haproxy_env.py writes: OpenAI's JSON error shape, each
  with its own status, like the ingress's errors (Ray maps 502/503/504 to a plain-text 500). HAProxy 2.8
  uses them for the errors of a request it has parsed (503: no server up; 502, 504, 500...); its HTTP/1
  parser answers a malformed request or one over its buffer (a 64 KiB header: 400) and a request that
  never arrives whole (408) with its built-in HTML page, errorfiles aside.
- The config is rewritten in place (Ray writes it anew before every start or reload) and the real
  binary replaces this process (`execv`: same pid), so Ray's pid checks on the admin socket and its
  `/proc/PID/cmdline` match on the config path keep working.
"""

from __future__ import annotations

import ctypes
import json
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


HEALTH_ROUTE = "/health"  # raytp's engine health route (the ingress's), answered by HAProxy when no replica is up
HEALTH_503_ENV = "RAYTP_HEALTH_503_FILE"  # the 503 answer (a raw HTTP response), written by haproxy_env.py
_HEALTH_MARK = "    # raytp: no ingress replica up -> 503 at once\n"


def _sections(lines: list[str]) -> list[tuple[str, int, int]]:
    """(header, first line, end) of each top-level section."""
    starts = [i for i, line in enumerate(lines) if line[:1] not in ("", " ", "\t", "\n", "#")]
    return [(lines[i].strip(), i, j) for i, j in zip(starts, [*starts[1:], len(lines)], strict=True)]


def _active_servers(lines: list[str], sections: list[tuple[str, int, int]]) -> dict[str, list[str]]:
    """backend name -> its servers that are not `backup` (the ingress replicas; the fallback proxy aside)."""
    found = {}
    for header, a, b in sections:
        if header.startswith("backend "):
            words = [ln.split() for ln in lines[a + 1 : b]]
            found[header.split()[1]] = [w[1] for w in words if w[:1] == ["server"] and "backup" not in w]
    return found


def _root_backend(frontend: list[str]) -> str | None:
    """The backend of the app at "/" (Ray renders `acl is_NAME path_beg /` for it)."""
    for line in frontend:
        words = line.split()
        if len(words) == 4 and words[0] == "acl" and words[2:] == ["path_beg", "/"] and words[1].startswith("is_"):
            return words[1][len("is_") :]
    return None


def answer_health_without_replicas(text: str, body_file: str) -> str:
    """Make HAProxy answer `GET /health` with 503 itself while the app at "/" has no ingress replica up.

    Why: while Serve replaces the only replica (its engine died), Ray's config leaves the app's backend
    with just Serve's fallback proxy (`backup`), and the proxy holds each request until a new replica
    has loaded the model: /health hung ~30 s instead of saying "unavailable". The rule names the
    backend's non-backup servers (`srv_is_up`; `nbsrv` would count the fallback) and, with none listed,
    holds for every /health. Other routes keep Ray's behaviour (they wait for the new replica).
    """
    lines = text.splitlines(keepends=True)
    if _HEALTH_MARK in lines:
        return text
    sections = _sections(lines)
    frontend = next(((a, b) for header, a, b in sections if header == "frontend http_frontend"), None)
    if frontend is None:
        return text
    body = lines[frontend[0] + 1 : frontend[1]]
    root, servers = _root_backend(body), _active_servers(lines, sections)
    routing = [i for i, ln in enumerate(body) if ln.lstrip().startswith(("use_backend", "default_backend"))]
    if root is None or root not in servers or not routing:
        return text
    down = "".join(f" !{{ srv_is_up({root}/{name}) }}" for name in servers[root])
    rule = f"    http-request return status 503 content-type application/json file {body_file}"
    rule += f" if {{ path {HEALTH_ROUTE} }}{down}\n"
    at = frontend[0] + 1 + routing[0]
    return "".join([*lines[:at], _HEALTH_MARK, rule, *lines[at:]])


ERROR_FILES_ENV = "RAYTP_ERROR_FILES"  # {"400": PATH, ...}: raw HTTP responses, written by haproxy_env.py
_ERRORS_MARK = "    # raytp: HAProxy's own errors in OpenAI's JSON shape\n"


def _is_errorfile_for(line: str, codes: set[str]) -> bool:
    words = line.split()
    return len(words) >= 2 and words[0] == "errorfile" and words[1] in codes


def use_error_files(text: str, files: dict[int, str]) -> str:
    """HAProxy's own answers for the codes in `files` (status -> a raw HTTP response) come from those files.

    Every `errorfile` line for one of these codes goes (Ray 2.60's, in `defaults`, send 502/503/504 as a
    plain-text 500), and `defaults` names the files instead: every frontend and backend inherits them.
    Idempotent.
    """
    lines = text.splitlines(keepends=True)
    if _ERRORS_MARK in lines or not files:
        return text
    covered = {str(code) for code in files}
    kept = [ln for ln in lines if not _is_errorfile_for(ln, covered)]
    defaults = next((b for header, _, b in _sections(kept) if header.split()[:1] == ["defaults"]), None)
    if defaults is None:
        return text
    while defaults > 0 and not kept[defaults - 1].strip():  # after the section's last directive
        defaults -= 1
    if defaults > 0 and not kept[defaults - 1].endswith("\n"):
        kept[defaults - 1] += "\n"
    added = [f"    errorfile {code} {path}\n" for code, path in sorted(files.items())]
    return "".join([*kept[:defaults], _ERRORS_MARK, *added, *kept[defaults:]])


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
    body_file = os.environ.get(HEALTH_503_ENV)
    if body_file:
        narrowed = answer_health_without_replicas(narrowed, body_file)
    error_files = os.environ.get(ERROR_FILES_ENV)
    if error_files:
        narrowed = use_error_files(narrowed, {int(code): path for code, path in json.loads(error_files).items()})
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
