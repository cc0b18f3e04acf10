"""The stats records refuse values that would make a counter go down or a dashboard lie."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.metrics.registry import FINISH_REASONS
from cluster.metrics.stats import BatchProgress, FinishedRequestStats, IterationStats, SchedulerStats
from tests.metrics.recording import FINISHED, SCHEDULER


def test_scheduler_stats_validation() -> None:
    with pytest.raises(ValueError, match="negative"):
        dataclasses.replace(SCHEDULER, num_waiting_reqs=-1)
    with pytest.raises(ValueError, match="fraction"):
        dataclasses.replace(SCHEDULER, kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="hits"):
        dataclasses.replace(SCHEDULER, prefix_cache_hits=SCHEDULER.prefix_cache_queries + 1)
    assert SchedulerStats(0, 0, 0, 0.0).prefix_cache_queries == 0


def test_finished_request_stats_validation() -> None:
    with pytest.raises(ValueError, match="durations"):
        dataclasses.replace(FINISHED[0], decode_time=-0.1)
    with pytest.raises(ValueError, match="n >= 1"):
        dataclasses.replace(FINISHED[0], n_param=0)
    assert {f.finish_reason for f in FINISHED} <= set(FINISH_REASONS)


def test_batch_progress_validation() -> None:
    assert BatchProgress(10, 4, 1).rows_done == 4
    with pytest.raises(ValueError):
        BatchProgress(10, 11, 0)
    with pytest.raises(ValueError):
        BatchProgress(10, 4, 5)


def test_iteration_stats_start_empty() -> None:
    stats = IterationStats()
    assert stats.finished_requests == [] and stats.time_to_first_tokens == [] and stats.step_time is None
    assert IterationStats().finished_requests is not stats.finished_requests
    assert isinstance(FINISHED[0], FinishedRequestStats)
