"""benchmarks/common/serving_load.py `sustained`: what `serving.py --find-max-rate` judges by, on synthetic servers."""

from __future__ import annotations

import argparse
import random

import pytest

from benchmarks import serving
from benchmarks.common.serving_load import Result, service_ratio, sustained


def _fifo_server(rate: float, service_rate: float, base_latency: float, seconds: float = 60.0) -> list[Result]:
    """Poisson arrivals at `rate` for `seconds`, served in order at `service_rate` requests/s, each taking
    at least `base_latency`: a server that keeps up when service_rate > rate, else builds a backlog."""
    rng = random.Random(0)
    results, t, done = [], 0.0, 0.0
    while t < seconds:
        done = max(t + base_latency, done + 1.0 / service_rate)
        results.append(Result(ok=True, sent=t, latency=done - t))
        t += rng.expovariate(rate)
    return results


def test_a_server_with_headroom_keeps_up() -> None:
    assert sustained(_fifo_server(rate=2.0, service_rate=3.0, base_latency=3.0))


def test_a_server_completing_less_than_offered_does_not() -> None:
    assert not sustained(_fifo_server(rate=3.0, service_rate=2.0, base_latency=3.0))


def test_a_long_backlog_is_not_mistaken_for_keeping_up() -> None:
    # Latency 25 s + a quarter of the arrival time: completions come at 0.8x the 4 req/s offered. The
    # middle third's median latency (~32 s) exceeds a third of the probe, so the shifted arrival window
    # is clipped at the first request (~28 s long against the completions' 40 s); comparing plain counts
    # over those windows once called this server sustained.
    results = [Result(ok=True, sent=t / 4, latency=25.0 + t / 16) for t in range(240)]
    assert not sustained(results)
    steady = [Result(ok=True, sent=t / 4, latency=25.0) for t in range(240)]  # the same lag, keeping up
    assert sustained(steady)


def test_a_failed_request_is_never_sustained() -> None:
    results = _fifo_server(rate=1.0, service_rate=3.0, base_latency=1.0)
    results[5].ok = False
    assert not sustained(results)


def test_the_service_ratio_estimates_service_over_offered_rate() -> None:
    # The figure each probe prints: ~1 for a server with headroom, ~service/offered for one without.
    assert 0.9 <= service_ratio(_fifo_server(rate=2.0, service_rate=3.0, base_latency=3.0, seconds=120)) <= 1.1
    assert 0.6 <= service_ratio(_fifo_server(rate=3.0, service_rate=2.0, base_latency=3.0, seconds=120)) <= 0.75
    assert service_ratio([Result(ok=True, sent=t, latency=100.0) for t in range(30)]) == 0.0  # latency > probe


def test_the_rate_search_records_every_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake server that keeps up to 1.3 req/s: doubling 0.5 -> 1 -> 2, then bisecting 1.5, 1.25, 1.375.
    def fake_measure(_args: argparse.Namespace, _url: str, work: list, rate: float) -> dict[str, object]:
        ratio = 1.0 if rate <= 1.3 else 1.3 / rate
        return {
            "sustained": rate <= 1.3,
            "service_ratio": ratio,
            "request_throughput": rate,
            "ttft_p50_ms": 1.0,
            "itl_p50_ms": 1.0,
            "failed": 0,
            "n": len(work),
        }

    monkeypatch.setattr(serving, "measure", fake_measure)
    args = argparse.Namespace(
        start_rate=0.5,
        max_rate=64.0,
        search_steps=3,
        num_prompts=4,
        probe_seconds=10.0,
        input_len=(4, 8),
        output_len=(2, 4),
        vocab=1000,
        seed=0,
    )
    found, probes = serving.find_max_rates(args, {"a": "http://a"})
    assert found == {"a": 1.25}
    assert [p["request_throughput"] for p in probes] == [0.5, 1.0, 2.0, 1.5, 1.25, 1.375]
    assert [p["n"] for p in probes] == [5, 10, 20, 15, 13, 14]  # max(num_prompts, rate x probe_seconds)
    assert all(p["server"] == "a" for p in probes) and [p["probe"] for p in probes] == [1, 2, 3, 4, 5, 6]
