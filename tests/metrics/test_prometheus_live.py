"""A real Prometheus scraping a real local Ray: every dashboard query returns data, by either path.

No model: an actor records a scripted set of stats that touches every raytp metric, and a tiny
Ray Serve app takes a few HTTP requests (some failing), so Serve's own series exist too. Two
Prometheus servers scrape the same cluster, one the node's metrics port (the KubeRay / service
discovery way), one a server answering with `application_metrics()` (the API port's /metrics).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from cluster.metrics.endpoint import CONTENT_TYPE, application_metrics
from tests.metrics.prom import PROMETHEUS, PROMETHEUS_MISSING, Prometheus, free_port, job
from tests.metrics.recording import Recorder
from tools.monitoring import alerts, dashboard, generate

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=PROMETHEUS_MISSING)

ROOT = Path(__file__).resolve().parents[2]
RATE = "5m"  # $__rate_interval: a window that holds both rounds of traffic for the whole module
EXPRS = [dashboard.substitute(t.expr, RATE) for p in dashboard.PANELS for t in p.targets]
SERIES = sorted({name for e in EXPRS for name in re.findall(r"\bray_[a-z0-9_]+", e)})  # what the panels read
OK_REQUESTS, FAILED_REQUESTS = 3, 2
# Rounds of traffic, each stored by both servers before the next is sent. A series first seen at its final
# value shows no increase (rate 0, quantiles NaN), so some round after the one that created a series must
# add to it. Two are not always enough: CI on 2026-11-26 found "HTTP request latency" empty with the
# request counts exact, so the API route's latency series first seen had not grown since. The likely way
# (not reproduced here): the first round answered before HAProxy marked the replica up, by Serve's fallback
# proxy, whose series (its own WorkerId) no later round touches. Rounds 2 and 3 reach the replica.
ROUNDS = 3
API_REQUESTS = f"ray_serve_num_http_requests_total{{{dashboard.API_ROUTES}}}"
API_LATENCIES = f"ray_serve_http_request_latency_ms_count{{{dashboard.API_ROUTES}}}"


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Echo:
    async def __call__(self, request: Request) -> PlainTextResponse:
        failing = request.url.path.endswith("/fail")
        return PlainTextResponse("no" if failing else "ok", status_code=500 if failing else 200)


class _MetricsHandler(BaseHTTPRequestHandler):
    """What the ingress's GET /metrics route does: answer with application_metrics()."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = asyncio.run(application_metrics()).encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class Live:
    nodes: Prometheus  # scrapes the node's metrics port
    api: Prometheus  # scrapes the /metrics page
    recorder: Any


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            status: int = resp.status
            return status
    except urllib.error.HTTPError as e:
        return e.code


def _traffic(http_port: int, recorder: Any) -> None:
    """One round of load: HTTP requests through Serve (some failing) and one round of engine stats."""
    statuses = [_get(f"http://127.0.0.1:{http_port}/hello") for _ in range(OK_REQUESTS)]
    statuses += [_get(f"http://127.0.0.1:{http_port}/fail") for _ in range(FAILED_REQUESTS)]
    assert statuses == [200] * OK_REQUESTS + [500] * FAILED_REQUESTS
    ray.get(recorder.record_all.remote())


def _wait_until_stored(prom: Prometheus, rounds: int) -> None:
    """Until `prom` holds every series the panels read, and every request of the first `rounds` rounds in the
    API route's request and latency series (not only Serve's health checks, which make them non-empty too)."""
    sent = float(rounds * (OK_REQUESTS + FAILED_REQUESTS))
    assert prom.wait_until_nonempty(SERIES, timeout_s=60) == [], prom.url
    deadline = time.monotonic() + 60
    while (got := [_total(prom, e) for e in (API_REQUESTS, API_LATENCIES)]) != [sent, sent]:
        assert time.monotonic() < deadline, f"{prom.url} holds {got} API requests of {sent} sent"
        time.sleep(0.5)


def _total(prom: Prometheus, selector: str) -> float:
    return sum(float(s["value"][1]) for s in prom.query(f"sum({selector})"))


@pytest.fixture(scope="module")
def live(ray_metrics_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    serve.run(Echo.bind(), name="metrics-test", route_prefix="/")  # type: ignore[attr-defined]
    recorder = Recorder.remote()  # type: ignore[attr-defined]

    api_server = ThreadingHTTPServer(("127.0.0.1", free_port()), _MetricsHandler)
    threading.Thread(target=api_server.serve_forever, daemon=True).start()
    work = tmp_path_factory.mktemp("prometheus")
    rules = [generate.ALERTS_PATH]
    nodes = Prometheus(work / "nodes", [job("ray", [f"127.0.0.1:{ray_metrics_port}"])], rules)
    api = Prometheus(work / "api", [job("raytp", [f"127.0.0.1:{api_server.server_address[1]}"])], rules)
    try:
        with nodes, api:
            for prom in (nodes, api):
                prom.wait_for_targets()
            for sent in range(1, ROUNDS + 1):
                _traffic(http_port, recorder)
                if sent < ROUNDS:
                    for prom in (nodes, api):
                        _wait_until_stored(prom, sent)
            yield Live(nodes, api, recorder)
    finally:
        api_server.shutdown()  # Serve ends with the module's Ray (conftest.py), as `raytp serve` ends it


@pytest.mark.parametrize("path", ["nodes", "api"])
def test_every_dashboard_query_returns_data(live: Live, path: str) -> None:
    prom: Prometheus = getattr(live, path)
    empty = prom.wait_until_nonempty(EXPRS, timeout_s=120)
    panels = sorted(
        {p.title for p in dashboard.PANELS for t in p.targets if dashboard.substitute(t.expr, RATE) in empty}
    )
    assert not empty, f"empty panels when scraping the {path}: {panels}\n" + "\n".join(empty)


def test_the_harness_names_empty_expressions(live: Live) -> None:
    real = "sum(ray_raytp_prompt_tokens_total)"
    assert live.nodes.wait_until_nonempty([real], timeout_s=60) == []
    assert live.nodes.empty(["ray_raytp_no_such_series", real]) == ["ray_raytp_no_such_series"]
    with pytest.raises(ValueError, match="refused"):
        live.nodes.query("sum(")


def _values(prom: Prometheus, expr: str) -> dict[str, float]:
    return {
        ",".join(f"{k}={v}" for k, v in sorted(s["metric"].items())): float(s["value"][1]) for s in prom.query(expr)
    }


@pytest.mark.parametrize(
    "expr,expected",
    [
        ("sum(ray_raytp_prompt_tokens_total)", {"": 30.0 * ROUNDS}),
        (
            "sum by (finished_reason) (ray_raytp_request_success_total)",
            {
                "finished_reason=abort": 0.0,
                "finished_reason=length": 1.0 * ROUNDS,
                "finished_reason=stop": 1.0 * ROUNDS,
            },
        ),
        ("sum(ray_raytp_time_to_first_token_seconds_count)", {"": 2.0 * ROUNDS}),
        ("sum(ray_raytp_num_requests_running)", {"": 3.0}),
        (  # exact codes: no answered request booked as a client abort (499), as HAProxy's log books some
            f"sum by (status_code) (ray_serve_num_http_requests_total{{{dashboard.API_ROUTES}}})",
            {"status_code=200": 1.0 * ROUNDS * OK_REQUESTS, "status_code=500": 1.0 * ROUNDS * FAILED_REQUESTS},
        ),
    ],
)
def test_both_paths_store_the_same_values(live: Live, expr: str, expected: dict[str, float]) -> None:
    # The /metrics page passes the node's series through; nothing is aggregated twice. Polled:
    # the last round of traffic reaches each server one export and one scrape later.
    for prom in (live.nodes, live.api):
        deadline = time.monotonic() + 60
        while (got := _values(prom, expr)) != expected and time.monotonic() < deadline:
            time.sleep(1)
        assert got == expected, prom.url


def test_alert_rules_load_evaluate_and_fire_on_a_worker_failure(live: Live) -> None:
    prom = live.nodes
    zero = 'sum(ray_raytp_worker_failures_total{rank="1"}) == 0'
    assert prom.wait_until_nonempty([zero], timeout_s=60) == [], "the failure counter must exist at 0 first"
    ray.get(live.recorder.record_worker_failure.remote())
    firing = 'ALERTS{alertname="RaytpWorkerFailed", alertstate="firing", rank="1"}'
    assert prom.wait_until_nonempty([firing], timeout_s=60) == [], prom.api("rules")
    groups = prom.api("rules")["groups"]
    assert [g["name"] for g in groups] == [alerts.GROUP]
    rules = groups[0]["rules"]
    assert sorted(r["name"] for r in rules) == sorted(r.alert for r in alerts.RULES)
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_preview_png_draws_every_panel(live: Live, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the `dev` extra's matplotlib draws the preview")
    spec = importlib.util.spec_from_file_location("dashboard_preview", ROOT / "benchmarks" / "dashboard_preview.py")
    assert spec is not None and spec.loader is not None
    preview = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preview)
    assert live.nodes.wait_until_nonempty(EXPRS, timeout_s=120) == []
    out = tmp_path / "dashboard.png"
    assert preview.render(live.nodes.url, out, minutes=2.0) == []
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
