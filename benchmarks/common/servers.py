"""OpenAI-compatible servers as benchmark subprocesses: `raytp serve` and vLLM's api_server, side by side.

Each server runs in a session of its own (so a stuck one can be ended with its whole process group)
and has its process tree's memory sampled from start to stop. `raytp serve` starts a private local Ray
instance (RAY_ADDRESS is removed from its environment), so its tree holds every process it costs:
the driver, Ray's GCS and raylet, the Serve proxy and HAProxy, the ingress replica (HTTP and the engine
loop) and the engine's worker actors.

Side by side, each server is paused (SIGSTOP to every process of its tree) while the other one is
measured: idle, `raytp serve` takes ~16% of a core (Serve's controller loop, the proxies, Ray's GCS,
raylet, agent and log monitor) and vLLM's server ~2% (`/proc` CPU time over 30 s idle, 2026-11-25), so
left running, raytp's daemons would slow vLLM's rounds more than vLLM's slow raytp's. A Ray cluster
stopped whole and resumed (70 s, tried twice) answered at once with the same replicas: its daemons time
each other out only when some of them run on while the others are stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from benchmarks.common.proc_mem import MemPeak, PeakSampler, tree
from benchmarks.common.vllm_baseline import DTYPE, KV_CACHE_BYTES, server_command, vllm_env

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """One server: started at construction, `wait_ready` polls /v1/models, `stop` ends it and returns its memory."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], port: int, log: IO[bytes] | None, ray_tree: bool
    ) -> None:
        self.name = name
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
            start_new_session=True,
        )
        self.memory = PeakSampler(self.proc.pid).start()
        # For a Ray tree, also the engine's own processes (driver + `ray::` workers) without Ray's daemons.
        self.engine_memory = PeakSampler(self.proc.pid, engine_only=True).start() if ray_tree else None
        self.started = time.perf_counter()
        self._paused: list[int] = []  # the processes `pause` stopped

    def wait_ready(self, timeout_s: float = 900.0) -> float:
        """Seconds from start until /v1/models answers; raises if the server dies or never answers."""
        self._wait_answering(self.started + timeout_s)
        return time.perf_counter() - self.started

    def _wait_answering(self, deadline: float) -> None:
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with code {self.proc.returncode} (see its log)")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} server did not answer /v1/models in time")

    def pause(self) -> None:
        """SIGSTOP every process of the tree, so an idle server takes no CPU from the other's rounds."""
        self._paused = tree(self.proc.pid)
        self._signal_all(self._paused, signal.SIGSTOP)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Resumed (and answering again) inside the block, paused again after it."""
        self._signal_all(self._paused, signal.SIGCONT)
        self._paused = []
        try:
            self._wait_answering(time.perf_counter() + 120.0)
            yield
        finally:
            self.pause()

    @staticmethod
    def _signal_all(pids: list[int], sig: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self) -> tuple[MemPeak, MemPeak | None]:
        """(whole tree, Ray workers + driver) peak memory; SIGINT first (both servers shut down cleanly on it)."""
        peaks = self.memory.stop(), self.engine_memory.stop() if self.engine_memory else None
        self._signal_all(self._paused, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: only what this server started
                self.proc.wait()
        return peaks


def start_raytp(model_dir: str, port: int, log: IO[bytes] | None, extra: list[str]) -> ServerProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    raytp = str(Path(sys.executable).with_name("raytp"))
    cmd = [raytp, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", DTYPE]
    cmd += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *extra]
    return ServerProcess("raytp", cmd, env, port, log, ray_tree=True)


def start_vllm(model_dir: str, port: int, log: IO[bytes] | None) -> ServerProcess:
    return ServerProcess("vllm", server_command(model_dir, port), vllm_env(), port, log, ray_tree=False)
