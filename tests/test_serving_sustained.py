"""benchmarks/serving_load.sustained: the judgement behind `serving.py --find-max-rate`, on synthetic servers."""

from __future__ import annotations

import random

from benchmarks.serving_load import Result, sustained


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
