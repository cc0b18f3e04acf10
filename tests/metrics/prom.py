"""A real Prometheus server for tests: start it on a free port with a scrape config, wait for its
targets, evaluate PromQL through its HTTP query API and say which expressions come back empty.

Reusable by the live end-to-end test (a Prometheus scraping `raytp serve` under load):

    with Prometheus(tmp_path, [job("raytp", ["127.0.0.1:8080"])]) as prom:
        prom.wait_for_targets()
        empty = prom.wait_until_nonempty(exprs, timeout_s=60)   # [] when every expression has data
        assert not empty, empty

The binaries come from Debian's `prometheus` package (.ci/setup.sh installs it when it can);
`PROMETHEUS_MISSING` is the reason to skip with where they are absent.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.ports import free_port

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
PROMETHEUS_MISSING = (
    "Debian's `prometheus` package (prometheus and promtool) is not installed; .ci/setup.sh installs it "
    "with apt-get when it runs as root on a Debian-like system"
)


def job(name: str, targets: Sequence[str], metrics_path: str = "/metrics") -> dict[str, Any]:
    """A scrape job over static `host:port` targets."""
    return {"job_name": name, "metrics_path": metrics_path, "static_configs": [{"targets": list(targets)}]}


class Prometheus:
    """A Prometheus process with its own config and storage under `workdir`; a context manager."""

    def __init__(
        self,
        workdir: Path,
        scrape_configs: Sequence[dict[str, Any]],
        rule_files: Sequence[Path] = (),
        scrape_interval: str = "1s",
    ) -> None:
        if PROMETHEUS is None:
            raise RuntimeError(PROMETHEUS_MISSING)
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": list(scrape_configs),
        }
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = workdir / "prometheus.log"

    def __enter__(self) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        cmd = [
            str(PROMETHEUS),
            f"--config.file={config_path}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            "--log.level=warn",
        ]
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait(lambda: self._get("/-/ready") is not None, 60.0, "Prometheus to become ready")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def log_tail(self, n: int = 2000) -> str:
        return self._log.read_text(errors="replace")[-n:] if self._log.exists() else ""

    # --- HTTP API ---------------------------------------------------------------------------
    def _get(self, path: str, **params: str) -> bytes | None:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body: bytes = resp.read()
                return body
        except OSError:
            return None

    def api(self, path: str, **params: str) -> Any:
        """`GET /api/v1/<path>`'s data; raises on an error answer (a bad query says why)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                answer = json.load(resp)
        except urllib.error.HTTPError as e:
            answer = json.load(e)
        if answer.get("status") != "success":
            raise ValueError(f"Prometheus refused {path} {params}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query now: the result series (empty list: no data)."""
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def empty(self, exprs: Iterable[str], finite: bool = True) -> list[str]:
        """The expressions that return no series, or (finite=True) only NaN / infinite values.

        A query whose every value is NaN (a quantile or a ratio over an interval that saw no
        events) draws as a blank panel in Grafana, so by default it counts as empty too.
        """
        return [e for e in exprs if not any(_has_data(s, finite) for s in self.query(e))]

    def targets(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.api("targets")["activeTargets"]
        return found

    def wait_for_targets(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Wait until every configured target has been scraped successfully; returns them."""

        def all_up() -> bool:
            targets = self.targets()
            return bool(targets) and all(t["health"] == "up" for t in targets)

        self._wait(all_up, timeout_s, "every scrape target to be up")
        return self.targets()

    def wait_until_nonempty(
        self, exprs: Sequence[str], timeout_s: float = 60.0, finite: bool = True, poll_s: float = 1.0
    ) -> list[str]:
        """Poll until every expression returns data (see `empty`); returns those still empty at the deadline."""
        deadline = time.monotonic() + timeout_s
        pending = list(exprs)
        while True:
            pending = self.empty(pending, finite)
            if not pending or time.monotonic() > deadline:
                return pending
            time.sleep(poll_s)

    def _wait(self, ready: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"Prometheus exited with {self._proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                detail = json.dumps(self.targets(), indent=1)[-3000:] if what.startswith("every") else self.log_tail()
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {detail}")
            time.sleep(0.5)


def _has_data(series: dict[str, Any], finite: bool) -> bool:
    values = [series["value"]] if "value" in series else series.get("values", [])
    return bool(values) and (not finite or any(math.isfinite(float(v)) for _, v in values))


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        raise RuntimeError(PROMETHEUS_MISSING)
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)
