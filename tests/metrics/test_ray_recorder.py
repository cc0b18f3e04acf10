"""The recorder against a real local Ray: an actor records, the node's metrics port shows it.

Also the /metrics collection (endpoint.py) against the same node: it must pass the node's raytp
series through unchanged.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics.endpoint import application_metrics, collect, node_metrics_urls
from tests.metrics.conftest import EXPORT_INTERVAL_MS
from tests.metrics.prom import free_port
from tests.metrics.recording import ENGINE, EXPECTED, EXPECTED_BATCH, JOB, MODEL, Recorder

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _series(text: str, prefix: str = "ray_raytp_") -> Series:
    """name + labels (Ray's own labels included) -> value, for the families under `prefix`."""
    out: Series = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(prefix):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _node_page(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text: str = resp.read().decode()
        return text


def _value(series: Series, name: str, labels: dict[str, str]) -> float | None:
    """Sum over the series of `name` whose labels include `labels` (None: no such series)."""
    found = [v for (n, ls), v in series.items() if n == name and labels.items() <= dict(ls).items()]
    return sum(found) if found else None


def _mismatches(series: Series) -> list[str]:
    bad = []
    for name, extra, want in EXPECTED:
        got = _value(series, name, {**ENGINE, **extra})
        if got is None or abs(got - want) > 1e-9:
            bad.append(f"{name}{extra}: want {want}, got {got}")
    for name, want in EXPECTED_BATCH:
        got = _value(series, name, {"model_name": MODEL, "batch_job": JOB})
        if got != want:
            bad.append(f"{name}: want {want}, got {got}")
    return bad


def _wait(check: Callable[[], list[str]], timeout_s: float) -> list[str]:
    """Poll `check` (which lists what is still wrong) until it lists nothing or time runs out."""
    deadline = time.monotonic() + timeout_s
    while (problems := check()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return problems


@pytest.fixture(scope="module")
def recorder(ray_metrics_port: int) -> Iterator[Any]:
    rec = Recorder.remote()  # type: ignore[attr-defined]
    ray.get(rec.record_all.remote())
    ray.get(rec.record_worker_failure.remote())
    problems = _wait(lambda: _mismatches(_series(_node_page(ray_metrics_port))), 60)
    assert not problems, "the node's metrics port does not show what was recorded:\n" + "\n".join(problems)
    yield rec


def test_recorded_stats_reach_the_node_metrics_port_exactly(ray_metrics_port: int, recorder: Any) -> None:
    page = _node_page(ray_metrics_port)
    assert _mismatches(_series(page)) == []
    # Every raytp series carries Ray's own labels beside ours: where it came from.
    one = next(ls for (n, ls) in _series(page) if n == "ray_raytp_prompt_tokens_total")
    assert {"Component", "NodeAddress", "SessionName", "WorkerId", "model_name", "replica"} <= dict(one).keys()
    # Every raytp family is named ray_raytp_* (a name with ':' would have been dropped by Ray).
    names = {fam.name for fam in text_string_to_metric_families(page) if "raytp" in fam.name}
    assert names and all(n.startswith("ray_raytp_") and ":" not in n for n in names)


def test_histogram_sum_is_approximate_but_the_exact_sum_is_exact(ray_metrics_port: int, recorder: Any) -> None:
    series = _series(_node_page(ray_metrics_port))
    # TTFT observations 0.3 and 1.2: Ray's _sum is rebuilt from bucket midpoints, 0.375 + 1.75.
    approx = _value(series, "ray_raytp_time_to_first_token_seconds_sum", ENGINE)
    exact = _value(series, "ray_raytp_time_to_first_token_seconds_sum_exact_total", ENGINE)
    assert exact == pytest.approx(1.5)
    assert approx is not None and approx != pytest.approx(1.5), "Ray's _sum became exact: drop the companion counter"


def test_collect_passes_the_node_series_through_unchanged(ray_metrics_port: int, recorder: Any) -> None:
    urls = node_metrics_urls()
    assert urls == [f"http://{ray.nodes()[0]['NodeManagerAddress']}:{ray_metrics_port}/metrics"]
    node = _series(_node_page(ray_metrics_port))
    merged = collect(urls)
    assert _series(merged) == node
    # Only raytp and Serve families: none of Ray's system series (ray_node_*, ray_tasks ...).
    assert _series(merged, prefix="") == node


def test_application_metrics_is_collect_over_the_node_table(recorder: Any) -> None:
    assert _series(asyncio.run(application_metrics())) == _series(collect(node_metrics_urls()))


def test_an_unreachable_node_is_named_not_fatal(recorder: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    text = collect([*node_metrics_urls(), dead])
    assert text.startswith(f"# raytp: skipped {dead}:")
    assert _mismatches(_series(text)) == []


def test_gauges_outlive_rays_gauge_ttl_and_age_out_after_close(ray_metrics_port: int, recorder: Any) -> None:
    running = ("ray_raytp_num_requests_running", ENGINE)
    # Ray drops a gauge not set again within two export intervals; wait five with no recording.
    time.sleep(5 * EXPORT_INTERVAL_MS / 1000)
    assert _value(_series(_node_page(ray_metrics_port)), *running) == 3
    ray.get(recorder.close.remote())

    def still_there() -> list[str]:
        return ["running gauge still exported"] if _value(_series(_node_page(ray_metrics_port)), *running) else []

    assert _wait(still_there, 60) == []
    series = _series(_node_page(ray_metrics_port))
    assert _value(series, "ray_raytp_prompt_tokens_total", ENGINE) == 30, "counters stay after close()"
    assert _value(series, "ray_raytp_batch_rows_done", {"batch_job": JOB}) is None


def test_the_recorder_refuses_draft_positions_beyond_its_k() -> None:
    from cluster.metrics.ray_metrics import EngineMetrics
    from cluster.metrics.stats import IterationStats, SpecDecodingStats

    # The positions must be the engine's k: a record with others is refused whole, before anything is recorded.
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        EngineMetrics(MODEL, "plain").record_iteration_stats(
            IterationStats(spec_decoding=SpecDecodingStats(1, 1, 1, (1,)))
        )
