"""`raytp serve` as a user runs it, in a subprocess a test can signal, time and account for.

Every process the server starts (Ray's, the model workers, HAProxy) inherits one marker variable, so a
test can see exactly what is left of its server after it stopped, and kill all of it (and nothing of
anyone else's) when the test ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "RAYTP_TEST_SERVER"
# A tiny model's smallest pools: several servers may share the machine.
SMALL = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 22), "--swap-space", "0.01"]


@dataclass
class ServeProcess:
    proc: subprocess.Popen[str]
    mark: str
    port: int
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        with contextlib.suppress(queue.Empty):
            while True:
                self.seen.append(self.lines.get_nowait())
        return "".join(self.seen[-60:])

    def wait_until_serving(self, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not any("raytp: serving" in line for line in self.seen):
            assert self.proc.poll() is None, "raytp serve exited early:\n" + self.output()
            assert time.monotonic() < deadline, "raytp serve did not come up:\n" + self.output()
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.lines.get(timeout=1))

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process carrying this server's marker (zombies aside)."""
        needle = f"{MARK}={self.mark}".encode()
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                ours = needle in (entry / "environ").read_bytes().split(b"\0")
                if ours and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        return found

    def stop_within(self, sig: signal.Signals, seconds: float) -> float:
        """Send `sig` to the server, assert it exits 0 within `seconds`; returns the seconds it took."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"raytp serve took over {seconds} s to exit on {sig.name}:\n{self.output()}") from None
        took = time.monotonic() - start
        assert rc == 0, f"exit {rc} on {sig.name}:\n{self.output()}"
        return took

    def kill_everything(self) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def wait_gone(server: ServeProcess, seconds: float) -> dict[int, str]:
    """Wait up to `seconds` for every process of `server` to end; returns those still alive."""
    deadline = time.monotonic() + seconds
    while (left := server.processes()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


@contextlib.contextmanager
def raytp_serve(model: str, port: int, *flags: str, env: dict[str, str] | None = None) -> Iterator[ServeProcess]:
    """Start `raytp serve MODEL --host 127.0.0.1 --port PORT FLAGS...` (its own Ray); on the way out, kill
    whatever of it is still running."""
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update(env or {})
    mark = uuid.uuid4().hex
    full_env[MARK] = mark
    cmd = [sys.executable, "-m", "raytp.cli.main", "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, *flags], cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    server = ServeProcess(proc, mark, port)
    threading.Thread(target=lambda: [server.lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        yield server
    finally:
        server.kill_everything()
