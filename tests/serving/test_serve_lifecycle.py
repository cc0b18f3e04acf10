"""`raytp serve` as a user runs it, and its operational edges, on real servers (slow: four starts of a tiny
model, so each start proves as much as it can).

- One command starts Ray, deploys, prints its URL and serves; the API key comes from RAYTP_API_KEY.
- Two servers on one host, on different API ports, run side by side: each one's HAProxy listens on its
  own API port only (no shared stats/exporter ports to collide on).
- Ctrl-C (SIGINT) and SIGTERM are back within seconds (Serve's graceful shutdown took 30-40 s), and
  nothing of the server is left running: Ray, the model workers, HAProxy.
- While Serve replaces a replica whose engine died, `GET /health` answers 503 at once (it hung ~30 s).
- After `kill -9` of `raytp serve` alone, nothing of it lives on (HAProxy used to keep the API port; Ray's
  two agents take up to a minute to follow), and the next `raytp serve` on the same port starts at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import requests

from raytp.serve.port_guard import listening_inodes
from tests.helpers.ports import free_port
from tests.helpers.serve_cli import SMALL, ServeProcess, raytp_serve, wait_gone
from tests.helpers.tiny_models import make_tiny_llama

RAY_AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}
STOP_S = 10.0  # the target is ~5 s; the bound leaves room for a loaded 2-core CI machine


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = fd.readlink().name
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def _haproxy_ports(processes: dict[int, str], candidates: list[int]) -> dict[int, set[int]]:
    """For each HAProxy among `processes`: which of `candidates` (and of Ray's 8404/9101) it listens on."""
    ports = {}
    for pid, cmd in processes.items():
        if Path(cmd.split(" ", 1)[0]).name == "haproxy":
            own = _socket_inodes(pid)
            ports[pid] = {p for p in [*candidates, 8404, 9101] if listening_inodes(p) & own}
    return ports


def _loopback_listeners(pid: int) -> set[int]:
    """The ports `pid` listens on at 127.0.0.1 (the --host these servers run with)."""
    own, ports = _socket_inodes(pid), set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        address, port = fields[1].split(":")
        if fields[3] == "0A" and fields[9] in own and address == "0100007F":
            ports.add(int(port, 16))
    return ports


def _fallback_proxy_ports(processes: dict[int, str]) -> set[int]:
    """Where Serve's fallback proxy (`ray::ProxyActor`) listens for HTTP from HAProxy."""
    return {p for pid, cmd in processes.items() if cmd.startswith("ray::ProxyActor") for p in _loopback_listeners(pid)}


KEY = "cli-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _models(base: str, headers: dict[str, str] | None = None) -> int:
    return requests.get(base + "/v1/models", headers=headers, timeout=30).status_code


def _serves_as_the_readme_says(server: ServeProcess, model: str) -> None:
    """The banner names the URL; without the RAYTP_API_KEY key a request is 401, with it the model answers."""
    banner = next(line for line in server.seen if "raytp: serving" in line)
    assert f"{server.base}/v1" in banner
    assert _models(server.base) == 401
    models = requests.get(server.base + "/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [model]
    body = {"prompt": "hi", "max_tokens": 4}
    r = requests.post(server.base + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _refuses_connections(server: ServeProcess) -> None:
    with pytest.raises(requests.ConnectionError):
        requests.get(server.base + "/health", timeout=5)


def test_side_by_side_fast_stops_nothing_left_and_a_killed_server_restarts(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path)
    port_a, port_b = free_port(), free_port()
    with raytp_serve(model, port_a, *SMALL, env={"RAYTP_API_KEY": KEY}) as a:
        a.wait_until_serving()  # one start at a time: two Ray clusters starting at once can time out on 2 cores
        with raytp_serve(model, port_b, *SMALL) as b:
            b.wait_until_serving()
            _side_by_side_then_stopped(model, a, b, port_a, port_b)


def _side_by_side_then_stopped(model: str, a: ServeProcess, b: ServeProcess, port_a: int, port_b: int) -> None:
    """Both serve (A with an API key), each HAProxy on its own port; then A by Ctrl-C, B by kill -9, C on B's
    port by SIGTERM."""
    _serves_as_the_readme_says(a, model)
    assert _models(b.base) == 200
    for server, port in ((a, port_a), (b, port_b)):
        haproxies = _haproxy_ports(server.processes(), [port_a, port_b])
        assert haproxies and all(p == {port} for p in haproxies.values()), haproxies
    # Each has its own fallback proxy (Ray's default, 8500 for all, let only the first server start one).
    fallback_a, fallback_b = _fallback_proxy_ports(a.processes()), _fallback_proxy_ports(b.processes())
    assert fallback_a and fallback_b and not fallback_a & fallback_b, (fallback_a, fallback_b)

    took = a.stop_within(signal.SIGINT, STOP_S)
    assert not wait_gone(a, 5), f"left running after Ctrl-C ({took:.1f} s): {a.processes()}"
    _refuses_connections(a)
    assert _models(b.base) == 200  # the other server is untouched

    b.proc.kill()  # kill -9 of `raytp serve` alone: its children get no signal from us
    b.proc.wait(timeout=30)
    # Ray's GCS and raylet die with their parent (Ray arms PR_SET_PDEATHSIG), the workers with the raylet,
    # HAProxy with its actor (raytp's shim). Ray's two agents notice the raylet's death within ~2 s but
    # first try for up to 60 s to report it to the GCS that died too (ray/_private/process_watcher.py).
    left = wait_gone(b, 10)
    assert all(cmd.split()[0] in RAY_AGENTS for cmd in left.values()), f"left running after kill -9: {left}"

    with raytp_serve(model, port_b, *SMALL) as c:  # the same port, at once
        c.wait_until_serving()
        assert _models(c.base) == 200
        took = c.stop_within(signal.SIGTERM, STOP_S)
        assert not wait_gone(c, 5), f"left running after SIGTERM ({took:.1f} s): {c.processes()}"
        _refuses_connections(c)
    assert not wait_gone(b, 90), f"Ray's agents outlived the killed server: {b.processes()}"


def test_health_answers_at_once_while_serve_replaces_the_replica(tmp_path: Path) -> None:
    """A TP worker killed: first the replica itself, then (while Serve replaces it) HAProxy answers 503 at
    once, until the new replica serves and /health is 200 again."""
    model = make_tiny_llama(tmp_path)
    with raytp_serve(model, free_port(), *SMALL) as server:
        server.wait_until_serving()
        assert requests.get(server.base + "/health", timeout=10).status_code == 200
        workers = [pid for pid, cmd in server.processes().items() if cmd.startswith("ray::Worker")]
        assert len(workers) == 1, server.processes()
        os.kill(workers[0], signal.SIGKILL)
        statuses, deadline = [], time.monotonic() + 300
        while not (503 in statuses and statuses[-1] == 200):
            assert time.monotonic() < deadline, f"no new replica within 300 s: {statuses}"
            # A timeout here (ReadTimeout) is the bug: /health held while no replica was up.
            statuses.append(requests.get(server.base + "/health", timeout=5).status_code)
            time.sleep(0.5)
        assert set(statuses) == {200, 503}, statuses
