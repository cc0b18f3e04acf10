"""A scripted set of stats that touches every raytp metric, recorded from a Ray actor, and the
exact values a node's metrics port must then show. Shared by the recorder, /metrics and live
Prometheus tests.
"""

from __future__ import annotations

from typing import Any

import ray

from cluster.metrics.stats import (
    BatchProgress,
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)

MODEL, REPLICA, JOB = "tiny-model", "replica-a", "job-1"
NUM_SPECULATIVE_TOKENS = 3  # the engine speculates: its spec_decode series exist, one per position
ENGINE = {"model_name": MODEL, "replica": REPLICA}

SCHEDULER = SchedulerStats(
    num_running_reqs=3,
    num_waiting_reqs=2,
    num_swapped_reqs=1,
    kv_cache_usage=0.5,
    prefix_cache_queries=100,
    prefix_cache_hits=40,
)
FINISHED = (
    FinishedRequestStats("stop", 2.0, 10, 5, 16, 1, 0.1, 0.3, 1.6),
    FinishedRequestStats("length", 3.25, 20, 4, 2, 2, 0.2, 0.5, 2.55),
)


def iteration() -> IterationStats:
    return IterationStats(
        num_prompt_tokens=30,
        num_generation_tokens=7,
        num_scheduled_tokens=37,
        num_preempted_reqs=1,
        time_to_first_tokens=[0.3, 1.2],
        inter_token_latencies=[0.02, 0.04, 0.06],
        finished_requests=list(FINISHED),
        step_time=0.05,
        # 4 rows carried proposals (7 tokens); 5 accepted: 3 drafts' first proposal, 2 drafts' second.
        spec_decoding=SpecDecodingStats(4, 7, 5, (3, 2, 0)),
    )


# (series, labels beyond the engine's, value) after `record_all` (SCHEDULER twice, iteration()
# once, one worker step on rank 0, healthy, the config info, batch progress) and `record_worker_failure` (rank 1).
EXPECTED: tuple[tuple[str, dict[str, str], float], ...] = (
    ("ray_raytp_num_requests_running", {}, 3),
    ("ray_raytp_num_requests_waiting", {}, 2),
    ("ray_raytp_num_requests_swapped", {}, 1),
    ("ray_raytp_kv_cache_usage_perc", {}, 0.5),
    ("ray_raytp_prefix_cache_queries_total", {}, 200),
    ("ray_raytp_prefix_cache_hits_total", {}, 80),
    ("ray_raytp_prompt_tokens_total", {}, 30),
    ("ray_raytp_generation_tokens_total", {}, 7),
    ("ray_raytp_num_preemptions_total", {}, 1),
    ("ray_raytp_request_success_total", {"finished_reason": "stop"}, 1),
    ("ray_raytp_request_success_total", {"finished_reason": "length"}, 1),
    ("ray_raytp_request_success_total", {"finished_reason": "abort"}, 0),  # created at 0
    ("ray_raytp_time_to_first_token_seconds_count", {}, 2),
    ("ray_raytp_time_to_first_token_seconds_sum_exact_total", {}, 1.5),
    ("ray_raytp_time_to_first_token_seconds_bucket", {"le": "0.25"}, 0),
    ("ray_raytp_time_to_first_token_seconds_bucket", {"le": "0.5"}, 1),
    ("ray_raytp_time_to_first_token_seconds_bucket", {"le": "2.5"}, 2),
    ("ray_raytp_inter_token_latency_seconds_count", {}, 3),
    ("ray_raytp_inter_token_latency_seconds_sum_exact_total", {}, 0.12),
    ("ray_raytp_e2e_request_latency_seconds_count", {}, 2),
    ("ray_raytp_e2e_request_latency_seconds_sum_exact_total", {}, 5.25),
    ("ray_raytp_request_queue_time_seconds_count", {}, 2),
    ("ray_raytp_request_prefill_time_seconds_count", {}, 2),
    ("ray_raytp_request_decode_time_seconds_sum_exact_total", {}, 4.15),
    ("ray_raytp_request_prompt_tokens_sum_exact_total", {}, 30),
    ("ray_raytp_request_generation_tokens_sum_exact_total", {}, 9),
    ("ray_raytp_request_params_n_sum_exact_total", {}, 3),
    ("ray_raytp_request_params_max_tokens_count", {}, 2),
    ("ray_raytp_iteration_tokens_total_count", {}, 1),
    ("ray_raytp_iteration_tokens_total_sum_exact_total", {}, 37),
    ("ray_raytp_engine_step_time_seconds_count", {}, 1),
    ("ray_raytp_worker_step_time_seconds_count", {"rank": "0"}, 1),
    ("ray_raytp_worker_failures_total", {"rank": "0"}, 0),  # created at 0 by num_ranks=2
    ("ray_raytp_worker_failures_total", {"rank": "1"}, 1),
    ("ray_raytp_engine_healthy", {}, 1),
    ("ray_raytp_model_config_info", {"quantization": "int8", "dtype": "float32"}, 1),
    ("ray_raytp_spec_decode_num_drafts_total", {}, 4),
    ("ray_raytp_spec_decode_num_draft_tokens_total", {}, 7),
    ("ray_raytp_spec_decode_num_accepted_tokens_total", {}, 5),
    ("ray_raytp_spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}, 3),
    ("ray_raytp_spec_decode_num_accepted_tokens_per_pos_total", {"position": "1"}, 2),
    ("ray_raytp_spec_decode_num_accepted_tokens_per_pos_total", {"position": "2"}, 0),  # created at 0
)
EXPECTED_BATCH: tuple[tuple[str, float], ...] = (
    ("ray_raytp_batch_rows_total", 10),
    ("ray_raytp_batch_rows_done", 4),
    ("ray_raytp_batch_rows_failed", 1),
)


@ray.remote(num_cpus=0)
class Recorder:
    """Stands in for the controller, a TP worker and the batch driver, all in one process."""

    def __init__(self) -> None:
        from cluster.metrics.ray_metrics import BatchMetrics, EngineMetrics, WorkerMetrics

        self.engine = EngineMetrics(MODEL, REPLICA, num_ranks=2, num_speculative_tokens=NUM_SPECULATIVE_TOKENS)
        self.worker = WorkerMetrics(MODEL, REPLICA, rank=0)
        self.batch = BatchMetrics(MODEL, JOB)

    def record_all(self) -> None:
        self.engine.record_scheduler_stats(SCHEDULER)
        self.engine.record_scheduler_stats(SCHEDULER)
        self.engine.record_iteration_stats(iteration())
        self.engine.record_health(True)
        self.engine.record_info("model_config_info", {"quantization": "int8", "dtype": "float32"})
        self.worker.record_step(0.02)
        self.batch.record_progress(BatchProgress(rows_total=10, rows_done=4, rows_failed=1))

    def record_worker_failure(self) -> None:
        """Separate from record_all: an alert on increase() needs the 0 scraped before the 1."""
        self.engine.record_worker_failure(1)

    def close(self) -> None:
        self.engine.close()
        self.batch.close()

    def pid(self) -> Any:
        import os

        return os.getpid()
