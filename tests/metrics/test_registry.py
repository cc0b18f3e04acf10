"""The registry: the names issue 11 asks for, vLLM's types and buckets, names Ray can export."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.metrics import registry
from cluster.metrics.registry import METRICS, build_1_2_5_buckets, exported_series, metric

ROOT = Path(__file__).resolve().parents[2]

# vLLM V1's metrics that raytp mirrors, with vLLM's types (vllm/v1/metrics/loggers.py).
VLLM_METRICS = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "num_requests_swapped": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "num_preemptions": "counter",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "request_success": "counter",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram",
    "request_params_n": "histogram",
    "request_params_max_tokens": "histogram",
}

# vLLM's bucket boundaries, transcribed from vllm/v1/metrics/buckets.py (the same lists the
# loggers.py of earlier V1 releases spelled out inline).
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
             20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0]  # fmt: skip
VLLM_ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
VLLM_N = [1, 2, 5, 10, 20]
VLLM_BUCKETS = {
    "time_to_first_token_seconds": VLLM_TTFT,
    "inter_token_latency_seconds": VLLM_ITL,
    "e2e_request_latency_seconds": VLLM_REQUEST_LATENCY,
    "request_queue_time_seconds": VLLM_REQUEST_LATENCY,
    "request_prefill_time_seconds": VLLM_REQUEST_LATENCY,
    "request_decode_time_seconds": VLLM_REQUEST_LATENCY,
    "iteration_tokens_total": VLLM_ITERATION_TOKENS,
    "request_params_n": VLLM_N,
}
# vLLM sizes these by max_model_len: build_1_2_5_buckets(max_model_len).
VLLM_TOKEN_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens")


@pytest.mark.parametrize("name,kind", sorted(VLLM_METRICS.items()))
def test_every_vllm_metric_is_there_with_vllms_type(name: str, kind: str) -> None:
    assert metric(name).name == f"raytp:{name}"
    assert metric(name).kind == kind


def test_raytp_only_metrics_are_there() -> None:
    assert metric("worker_step_time_seconds").kind == "histogram"
    assert "rank" in metric("worker_step_time_seconds").labels
    assert metric("worker_failures").kind == "counter"
    # vLLM's way of exporting config (vllm:cache_config_info): a gauge whose labels are the facts
    info = metric("model_config_info")
    assert info.kind == "gauge" and info.labels == ("model_name", "replica", "quantization", "dtype")
    assert info.samples == ("ray_raytp_model_config_info",)
    for name in ("batch_rows_total", "batch_rows_done", "batch_rows_failed"):
        assert metric(name).kind == "gauge"
        assert metric(name).labels == ("model_name", "batch_job")


@pytest.mark.parametrize("name,expected", sorted(VLLM_BUCKETS.items()))
def test_buckets_are_vllms(name: str, expected: list[float]) -> None:
    assert list(metric(name).buckets) == expected


@pytest.mark.parametrize("name", VLLM_TOKEN_HISTOGRAMS)
@pytest.mark.parametrize("max_model_len", [512, 2048, 8192, 131072])
def test_token_buckets_start_with_vllms_for_any_max_model_len(name: str, max_model_len: int) -> None:
    vllm = build_1_2_5_buckets(max_model_len)
    assert list(metric(name).buckets[: len(vllm)]) == list(vllm)


def test_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(1) == (1,)
    assert registry.REQUEST_TOKENS_BUCKETS[-1] == registry.TOKEN_BUCKETS_MAX


def test_engine_labels_and_finish_reasons() -> None:
    for m in METRICS:
        assert m.labels[0] == "model_name", m.name
        assert ("replica" in m.labels) != ("batch_job" in m.labels), m.name
    assert metric("request_success").labels == ("model_name", "replica", "finished_reason")
    assert registry.FINISH_REASONS == ("stop", "length", "abort")


def test_names_are_ones_ray_exports() -> None:
    # Ray's OpenTelemetry exporter drops any name outside [a-zA-Z0-9_] (':' included).
    for m in METRICS:
        assert re.fullmatch(r"raytp_[a-z0-9_]+", m.ray_name), m.ray_name
        assert m.series == f"ray_{m.ray_name}"
    assert metric("prompt_tokens").samples == ("ray_raytp_prompt_tokens_total",)
    assert metric("kv_cache_usage_perc").samples == ("ray_raytp_kv_cache_usage_perc",)
    assert metric("time_to_first_token_seconds").samples == (
        "ray_raytp_time_to_first_token_seconds_bucket",
        "ray_raytp_time_to_first_token_seconds_sum",
        "ray_raytp_time_to_first_token_seconds_count",
    )


def test_every_histogram_has_an_exact_sum_counter() -> None:
    series = exported_series()
    for m in METRICS:
        exact = m.exact_sum
        if m.kind == "histogram":
            assert exact is not None and exact.kind == "counter" and exact.labels == m.labels
            assert f"{m.series}_sum_exact_total" in series
        else:
            assert exact is None


def test_names_and_samples_are_unique() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    samples = [s for m in METRICS for d in (m, m.exact_sum) if d is not None for s in d.samples]
    assert len(samples) == len(set(samples))


def test_bad_definitions_are_refused() -> None:
    with pytest.raises(ValueError, match="raytp:"):
        registry.MetricDef("vllm:x", "gauge", "h")
    with pytest.raises(ValueError, match="buckets"):
        registry.MetricDef("raytp:x", "histogram", "h")
    with pytest.raises(ValueError, match="increase"):
        registry.MetricDef("raytp:x", "histogram", "h", buckets=(1.0, 1.0))


def test_metrics_package_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys, cluster.metrics, cluster.metrics.registry, cluster.metrics.stats;"
        "bad = {'torch', 'ray'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
