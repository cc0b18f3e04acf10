"""A `ray start --head` cluster of a test's own: private temp dir, every port chosen free."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.ports import free_port

BIN = Path(sys.executable).parent


@contextlib.contextmanager
def local_ray_cluster(env: dict[str, str], log: Path) -> Iterator[str]:
    """`ray start --head --block` in its own process group; yields the dashboard (job API) address.

    Every port is chosen free and the temp dir is private, so other clusters on this machine are
    untouched; stopping it signals only this process group.
    """
    dashboard = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rtp", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", f"--port={free_port()}", f"--dashboard-port={dashboard}",
        "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}", f"--ray-client-server-port={free_port()}",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"ray start exited: {log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=5).close()
                break
            except urllib.error.HTTPError:  # an answer all the same (401 under token auth): it is up
                break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the Ray dashboard did not come up: {log.read_text()[-3000:]}"
            time.sleep(1)
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
