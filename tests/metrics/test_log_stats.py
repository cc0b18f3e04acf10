"""The periodic log lines (cluster/metrics/log_stats.py): vLLM's wording, sums over the interval, rates over the
time elapsed, the spec line only with drafts, and quiet when idle. Plain Python: no engine, no Ray."""

from __future__ import annotations

import logging

import pytest

from cluster.metrics.log_stats import StatsLogger
from cluster.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats


def _step(prompt: int, generated: int, spec: SpecDecodingStats | None = None) -> IterationStats:
    return IterationStats(num_prompt_tokens=prompt, num_generation_tokens=generated, spec_decoding=spec)


def test_engine_and_spec_lines_sum_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    log = StatsLogger("smol", num_speculative_tokens=3, interval_s=10.0, now=0.0)
    log.observe_scheduler(SchedulerStats(2, 1, 0, 0.25, prefix_cache_queries=40, prefix_cache_hits=10))
    log.observe_iteration(_step(100, 12, SpecDecodingStats(4, 10, 5, (3, 2, 0))))
    log.observe_iteration(_step(0, 8, SpecDecodingStats(4, 10, 3, (2, 1, 0))))
    assert log.maybe_log(now=9.9) == [], "not due before the interval"
    with caplog.at_level(logging.INFO, logger="cluster.metrics.log_stats"):
        lines = log.maybe_log(now=20.0)
    assert lines == [
        "Engine smol: Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 1.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%",
        # 8 drafts, 20 proposed, 8 accepted: 1 + 8/8; per position 5/8, 3/8, 0/8; 8/20.
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 0.40 tokens/s, "
        "Drafted throughput: 1.00 tokens/s, Accepted: 8 tokens, Drafted: 20 tokens, "
        "Per-position acceptance rate: 0.625, 0.375, 0.000, Avg Draft acceptance rate: 40.0%",
    ]
    assert [r.getMessage() for r in caplog.records] == lines
    # A new interval starts from zero: no drafts, no spec line; the engine line still shows the last interval's work.
    log.observe_iteration(_step(0, 5, SpecDecodingStats(0, 0, 0, (0, 0, 0))))
    (line,) = log.maybe_log(now=30.0)
    assert "Avg generation throughput: 0.5 tokens/s" in line and "Prefix cache hit rate: 0.0%" in line


def test_an_idle_engine_logs_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    log = StatsLogger("smol", interval_s=1.0, now=0.0)
    log.observe_iteration(_step(3, 1))
    assert len(log.maybe_log(now=1.0)) == 1  # work in this interval
    assert len(log.maybe_log(now=2.0)) == 1  # none now, but the previous one had some: the drop shows
    with caplog.at_level(logging.DEBUG, logger="cluster.metrics.log_stats"):
        assert log.maybe_log(now=3.0) == []
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert caplog.records[0].getMessage().startswith("Engine smol: Avg prompt throughput: 0.0 tokens/s")


def test_spec_stats_must_add_up() -> None:
    with pytest.raises(ValueError, match="add up"):
        SpecDecodingStats(2, 4, 3, (1, 1))
    with pytest.raises(ValueError, match="accepted"):
        SpecDecodingStats(1, 2, 3, (1, 1, 1))
