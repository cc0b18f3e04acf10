"""A live raytp Serve app (the embedded SmolLM2) scraped by a real Prometheus: every dashboard query
returns data, and the counters agree with what the clients received.

The engine here is the real one: the engine loop in the LLMServer replica, a Ray TP worker, small KV pool (so the load
preempts). Prometheus scrapes the Ray node's metrics port, the target that
k8s/prometheus/prometheus.yml finds through Ray's service-discovery file (that file is written by
Ray's dashboard, which these tests do not start, so the same port is given statically). The load
runs in two rounds: Prometheus must see each counter before and after a rise for rate() and
histogram_quantile() to have data.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from raytp.serve.app import build_app
from tests.metrics.prom import PROMETHEUS, PROMETHEUS_MISSING, Prometheus, free_port, job
from tools.monitoring import dashboard

pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROMETHEUS is None, reason=PROMETHEUS_MISSING)]

API_KEY = "metrics-test-key"
SERVED_NAME = "smol"  # --served-model-name: the metrics' model_name label is the name clients use
RATE = "5m"  # $__rate_interval: a window that holds both rounds of the load
# A serving load has no batch job: the batch panels' series come from `raytp batch`, and
# test_prometheus_live.py proves those queries with a recorded BatchProgress.
BATCH_PANELS = {"Batch job rows", "Batch job completion"}
EXPRS = {
    dashboard.substitute(t.expr, RATE): p.title
    for p in dashboard.PANELS
    if p.title not in BATCH_PANELS
    for t in p.targets
}
ENGINE = {
    "max_model_len": 256,
    "block_size": 16,
    "num_gpu_blocks_override": 12,  # 192 tokens: four 60-token requests at once must preempt
    "swap_space": 0.05,
    "max_num_seqs": 8,
    # n-gram speculation leaves every output as it is without it (tests/cluster/test_speculative_engine.py), so
    # the assertions below hold as they would without it, and its series and panels have data.
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    },
}
# Longer than two KV blocks and sent several times: the prefix cache hits.
PROMPT = (
    "You are a helpful assistant who answers geography questions briefly and accurately. "
    "Question: what is the capital city of France? Answer: The capital of France is"
)


@dataclass
class Tally:
    """What the clients received."""

    completion_tokens: int = 0
    reasons: Counter[str] = field(default_factory=Counter)  # request finish reason -> requests

    def add(self, tokens: int, choice_reasons: Sequence[str | None]) -> None:
        assert len(set(choice_reasons)) == 1, f"the load is built so a request's choices agree: {choice_reasons}"
        self.completion_tokens += tokens
        self.reasons[str(choice_reasons[0])] += 1


@dataclass
class Live:
    base_url: str
    prom: Prometheus
    tally: Tally


def _round(client: openai.OpenAI, model: str, tally: Tally) -> None:
    """One round of mixed load: plain, streamed, n=2, a stop string, four at once (preempting)."""
    long = {"ignore_eos": True}
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=long)
    assert r.usage is not None
    tally.add(r.usage.completion_tokens, [c.finish_reason for c in r.choices])

    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, stream=True, stream_options={"include_usage": True},
        extra_body=long,
    )  # fmt: skip
    reasons: list[str | None] = []
    usage = None
    for chunk in stream:
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason is not None]
        usage = chunk.usage or usage
    assert usage is not None
    tally.add(usage.completion_tokens, reasons)

    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, n=2, extra_body=long)
    assert r.usage is not None and len(r.choices) == 2
    tally.add(r.usage.completion_tokens, [c.finish_reason for c in r.choices])

    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0, stop=[" "])
    assert r.usage is not None and r.choices[0].finish_reason == "stop"
    tally.add(r.usage.completion_tokens, [c.finish_reason for c in r.choices])

    def busy(i: int) -> None:
        out = client.completions.create(
            model=model, prompt=f"Request {i}: list some fruits", max_tokens=48, extra_body=long
        )
        assert out.usage is not None
        with lock:
            tally.add(out.usage.completion_tokens, [c.finish_reason for c in out.choices])

    lock = threading.Lock()
    threads = [threading.Thread(target=busy, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Refused requests, so Serve's error series have data: a bad field (400) and a missing key (401).
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=-1)
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").models.list()


def _value(prom: Prometheus, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def _wait_value(prom: Prometheus, expr: str, expected: float, timeout_s: float = 60.0) -> float | None:
    """Poll until `expr` equals `expected` (values reach Prometheus one export and one scrape later)."""
    deadline = time.monotonic() + timeout_s
    while (got := _value(prom, expr)) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


@pytest.fixture(scope="module")
def live(ray_metrics_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    # Serve ends with the module's Ray (conftest.py), at once, as `raytp serve` ends it: serve.shutdown()
    # would wait out Serve's 30 s drain period for direct-ingress replicas.
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    args = {**ENGINE, "api_key": API_KEY, "served_model_name": SERVED_NAME}
    serve.run(build_app(args), name="raytp", route_prefix="/")
    base = f"http://127.0.0.1:{http_port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == SERVED_NAME
    work = tmp_path_factory.mktemp("prometheus")
    with Prometheus(work, [job("ray", [f"127.0.0.1:{ray_metrics_port}"])]) as prom:
        prom.wait_for_targets()
        # The controller creates its counters at 0: Prometheus must store that before the first rise.
        assert _wait_value(prom, "sum(ray_raytp_generation_tokens_total)", 0.0) == 0.0
        tally = Tally()
        for _ in range(2):
            _round(client, model, tally)
            got = _wait_value(prom, "sum(ray_raytp_generation_tokens_total)", tally.completion_tokens)
            assert got == tally.completion_tokens, "generation_tokens must equal the completion tokens received"
        yield Live(base, prom, tally)


def test_every_dashboard_query_returns_data(live: Live) -> None:
    empty = live.prom.wait_until_nonempty(list(EXPRS), timeout_s=90)
    panels = sorted({EXPRS[e] for e in empty})
    assert not empty, f"empty panels: {panels}\n" + "\n".join(empty)


def test_counters_agree_with_what_the_clients_received(live: Live) -> None:
    prom, tally = live.prom, live.tally
    assert _value(prom, "sum(ray_raytp_generation_tokens_total)") == tally.completion_tokens
    requests = sum(tally.reasons.values())
    for reason in ("stop", "length", "abort"):
        expr = f'sum(ray_raytp_request_success_total{{finished_reason="{reason}"}})'
        assert _wait_value(prom, expr, tally.reasons[reason]) == tally.reasons[reason], reason
    assert _value(prom, "sum(ray_raytp_request_success_total)") == requests
    assert _value(prom, "sum(ray_raytp_e2e_request_latency_seconds_count)") == requests
    assert _value(prom, "sum(ray_raytp_request_params_n_count)") == requests
    # The small KV pool forced preemptions; the repeated prompt hit the prefix cache.
    preemptions = _value(prom, "sum(ray_raytp_num_preemptions_total)")
    assert preemptions is not None and preemptions > 0
    hits = _value(prom, "sum(ray_raytp_prefix_cache_hits_total)")
    assert hits is not None and hits > 0
    ranks = prom.query("sum by (rank) (ray_raytp_worker_step_time_seconds_count)")
    assert [s["metric"]["rank"] for s in ranks] == ["0"]
    assert _value(prom, "min(ray_raytp_engine_healthy)") == 1.0
    # Speculation proposed and the target accepted some; every accepted token is counted at its position.
    drafts, drafted, accepted = (
        _value(prom, f"sum(ray_raytp_spec_decode_num_{n}_total)") for n in ("drafts", "draft_tokens", "accepted_tokens")
    )
    assert drafts is not None and drafted is not None and accepted is not None
    assert 0 < drafts <= drafted <= 3 * drafts and 0 < accepted <= drafted
    per_pos = prom.query("sum by (position) (ray_raytp_spec_decode_num_accepted_tokens_per_pos_total)")
    assert sorted(s["metric"]["position"] for s in per_pos) == ["0", "1", "2"]
    assert sum(float(s["value"][1]) for s in per_pos) == accepted
    labels = prom.query("count by (model_name) (ray_raytp_generation_tokens_total)")
    assert [s["metric"]["model_name"] for s in labels] == [SERVED_NAME]


def test_an_aborted_stream_counts_as_abort(live: Live) -> None:
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    before = _value(live.prom, 'sum(ray_raytp_request_success_total{finished_reason="abort"})') or 0.0
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the request runs ...
    stream.close()  # ... and the client goes away: the engine aborts it
    expr = 'sum(ray_raytp_request_success_total{finished_reason="abort"})'
    assert _wait_value(live.prom, expr, before + 1) == before + 1


def test_metrics_route_serves_the_same_series_without_the_api_key(live: Live) -> None:
    with urllib.request.urlopen(f"{live.base_url}/metrics", timeout=30) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"ray_raytp_generation_tokens", "ray_serve_num_http_requests"} <= set(families)
    # A pass-through of the node's series: the same total Prometheus stored from the node port.
    page = sum(s.value for s in families["ray_raytp_generation_tokens"].samples if s.name.endswith("_total"))
    assert page == _value(live.prom, "sum(ray_raytp_generation_tokens_total)")
    assert not any(name.startswith("ray_") and not name.startswith(("ray_raytp_", "ray_serve_")) for name in families)


def test_preview_renders_the_live_dashboard(live: Live, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the `dev` extra's matplotlib draws the preview")
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("dashboard_preview", root / "benchmarks" / "dashboard_preview.py")
    assert spec is not None and spec.loader is not None
    preview = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preview)
    assert live.prom.wait_until_nonempty(list(EXPRS), timeout_s=90) == []
    # RAYTP_PREVIEW_OUT=path keeps the picture (the preview of what the dashboard shows under this load).
    out = Path(os.environ.get("RAYTP_PREVIEW_OUT") or tmp_path / "dashboard.png")
    empty = preview.render(live.prom.url, out, minutes=3.0)
    assert set(empty) <= BATCH_PANELS, empty
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
