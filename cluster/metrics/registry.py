"""THE list of raytp's metrics: name, type, help, labels, buckets. Everything else derives from it.

The recorder (`ray_metrics.py`) creates its Ray instruments from these definitions, the Grafana
dashboard and the alert rules are generated from them, and tests check that every dashboard and
alert expression names a series listed here (or one of Ray Serve's, listed below). A metric that
is not here cannot be recorded, drawn or alerted on.

Names are vLLM V1's with `raytp:` instead of `vllm:`. What Prometheus sees is fixed by Ray's
metrics pipeline (checked on Ray 2.60, see `MetricDef.series`):

    raytp:prompt_tokens (counter)              -> ray_raytp_prompt_tokens_total
    raytp:num_requests_running (gauge)         -> ray_raytp_num_requests_running
    raytp:e2e_request_latency_seconds (hist.)  -> ray_raytp_e2e_request_latency_seconds_{bucket,sum,count}

Ray drops a metric whose name holds ':' (its OpenTelemetry exporter refuses the name; Ray 2.60
warns that ':' will become an error), so the recorder passes `raytp_...` to Ray, and Ray prefixes
every application metric with `ray_` and counters with a `_total` suffix. vLLM's own Ray path
does the same (`ray_vllm_...`), so a vLLM dashboard still ports by a prefix change.

Bucket boundaries are vLLM's (vllm/v1/metrics/buckets.py), with one deliberate difference: vLLM
sizes its token-count histograms by max_model_len (1-2-5 up to it); raytp uses one fixed 1-2-5
series up to `TOKEN_BUCKETS_MAX`, because Ray registers a histogram once per node and silently
skips data points from any process whose bucket count differs (two models with different
max_model_len on one node would lose one model's histograms). The fixed series starts with
exactly vLLM's boundaries, so quantiles below max_model_len are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["counter", "gauge", "histogram"]

# Labels every engine metric carries: the served model name and the model replica (the Ray Serve
# replica that owns the engine; vLLM calls its equivalent label "engine").
ENGINE_LABELS: tuple[str, ...] = ("model_name", "replica")
# Batch job metrics: one series per job, whichever replicas serve its rows.
BATCH_LABELS: tuple[str, ...] = ("model_name", "batch_job")

# vLLM's FinishReason values, the label values of raytp:request_success (scheduler/sequence.py maps
# FINISHED_STOPPED -> stop, FINISHED_LENGTH_CAPPED and FINISHED_IGNORED -> length, FINISHED_ABORTED -> abort).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# --- vLLM's bucket families (vllm/v1/metrics/buckets.py) -----------------------------------------
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
TOKEN_BUCKETS_MAX = 1_000_000


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value inclusive (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


REQUEST_TOKENS_BUCKETS: tuple[float, ...] = build_1_2_5_buckets(TOKEN_BUCKETS_MAX)

# --- raytp's own: one engine step, from 0.5 ms (a GPU decode step) to 10 s (a long CPU prefill) ---
STEP_TIME_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True)
class MetricDef:
    name: str  # canonical name, vLLM's with a raytp: prefix ("raytp:prompt_tokens")
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ENGINE_LABELS
    buckets: tuple[float, ...] = ()  # histograms only: upper bounds, strictly increasing (+Inf is implicit)
    # "record.field": the field of a stats record (cluster/metrics/stats.py; records in SOURCES) that the recorder
    # reads it from, each record's metrics recorded by one loop (a gauge set, a counter added, a histogram
    # observed); "": recorded by a method of its own in ray_metrics.py (labels beyond the engine's, lists).
    source: str = ""

    def __post_init__(self) -> None:
        if not self.name.startswith("raytp:"):
            raise ValueError(f"{self.name}: raytp metric names start with 'raytp:'")
        if self.source and self.source.split(".")[0] not in SOURCES:
            raise ValueError(f"{self.name}: source {self.source!r} names no record of {', '.join(SOURCES)}")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms, and only histograms, have buckets")
        if any(b >= c for b, c in zip(self.buckets, self.buckets[1:], strict=False)):
            raise ValueError(f"{self.name}: buckets must increase strictly")

    @property
    def ray_name(self) -> str:
        """The name handed to ray.util.metrics: ':' is not allowed there."""
        return self.name.replace(":", "_")

    @property
    def series(self) -> str:
        """The metric family name Prometheus sees: Ray prefixes application metrics with `ray_`."""
        return f"ray_{self.ray_name}"

    @property
    def exact_sum(self) -> MetricDef | None:
        """A histogram's companion counter of the exact sum of its observations (None otherwise).

        Ray's histograms export `_sum` as the sum of bucket *midpoints* (Ray 2.60 rebuilds each
        observation from aggregated bucket counts), which can be tens of percent off; `_count` and
        the buckets are exact. Means on the dashboard therefore divide this counter by `_count`.
        """
        if self.kind != "histogram":
            return None
        return MetricDef(f"{self.name}_sum_exact", "counter", f"Exact sum of {self.name} observations.", self.labels)

    @property
    def samples(self) -> tuple[str, ...]:
        """Every sample name this metric puts on a Ray node's metrics port."""
        if self.kind == "counter":
            return (f"{self.series}_total",)
        if self.kind == "histogram":
            return (f"{self.series}_bucket", f"{self.series}_sum", f"{self.series}_count")
        return (self.series,)


# (name, kind, help, SchedulerStats field): the metrics read from SchedulerStats.
_SCHEDULER_ROWS: tuple[tuple[str, MetricKind, str, str], ...] = (
    ("num_requests_running", "gauge", "Number of requests in model execution batches.", "num_running_reqs"),
    ("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "num_waiting_reqs"),
    ("num_requests_swapped", "gauge", "Number of requests swapped out to CPU memory.", "num_swapped_reqs"),
    ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    ("prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
)

# The stats records whose metrics are read field by field (`MetricDef.source`): SchedulerStats, IterationStats,
# SpecDecodingStats and each finished request's FinishedRequestStats.
SOURCES: tuple[str, ...] = ("scheduler", "iteration", "spec_decoding", "finished")


def _engine(
    name: str,
    kind: MetricKind,
    help: str,
    buckets: tuple[float, ...] = (),
    extra: tuple[str, ...] = (),
    source: str = "",
) -> MetricDef:
    return MetricDef(f"raytp:{name}", kind, help, ENGINE_LABELS + extra, buckets, source)


METRICS: tuple[MetricDef, ...] = (
    # Read from SchedulerStats (the controller, after each schedule()): the queues and the KV pool (gauges), the
    # prefix-cache lookups since the previous record (counters).
    *(
        _engine(name, kind, help, source=f"scheduler.{field}")
        for name, kind, help, field in _SCHEDULER_ROWS
    ),
    # Read from IterationStats (the output path, once per step): counters.
    *(
        _engine(name, "counter", help, source=f"iteration.{field}")
        for name, help, field in (
            ("prompt_tokens", "Number of prefill tokens processed.", "num_prompt_tokens"),
            ("generation_tokens", "Number of generation tokens processed.", "num_generation_tokens"),
            ("num_preemptions", "Cumulative number of preemption from the engine.", "num_preempted_reqs"),
        )
    ),
    _engine(
        "request_success", "counter", "Count of successfully processed requests.", extra=("finished_reason",)
    ),
    # Per-request histograms (observed when a request finishes, TTFT/ITL when tokens are produced).
    _engine(
        "time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
        TIME_TO_FIRST_TOKEN_BUCKETS,
    ),
    _engine(
        "inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    # Read from each finished request's FinishedRequestStats: histograms.
    *(
        _engine(name, "histogram", help, buckets, source=f"finished.{field}")
        for name, help, buckets, field in (
            ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS,
             "e2e_latency"),
            ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             REQUEST_LATENCY_BUCKETS, "queued_time"),
            ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             REQUEST_LATENCY_BUCKETS, "prefill_time"),
            ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
             REQUEST_LATENCY_BUCKETS, "decode_time"),
            ("request_prompt_tokens", "Number of prefill tokens processed.", REQUEST_TOKENS_BUCKETS,
             "num_prompt_tokens"),
            ("request_generation_tokens", "Number of generation tokens processed.", REQUEST_TOKENS_BUCKETS,
             "num_generation_tokens"),
            ("request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS, "n_param"),
        )
    ),
    _engine(
        "iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.",
        ITERATION_TOKENS_BUCKETS,
    ),
    _engine(
        "request_params_max_tokens", "histogram", "Histogram of the max_tokens request parameter.",
        REQUEST_TOKENS_BUCKETS,
    ),
    # Speculative decoding (vLLM V1's SpecDecodingProm): only engines with a speculative_config record them.
    # A draft is one row that carried proposals; `position` is the proposal's index in its draft, 0 to k - 1.
    # Read from SpecDecodingStats: counters.
    *(
        _engine(f"spec_decode_{field}", "counter", help, source=f"spec_decoding.{field}")
        for field, help in (
            ("num_drafts", "Number of spec decoding drafts."),
            ("num_draft_tokens", "Number of draft tokens."),
            ("num_accepted_tokens", "Number of accepted tokens."),
        )
    ),
    _engine(
        "spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
        extra=("position",),
    ),
    # raytp's own: what only a Ray-native engine can show.
    _engine(
        "engine_step_time_seconds", "histogram",
        "Wall time of one engine step in the controller (schedule, execute on all ranks, update).",
        STEP_TIME_BUCKETS,
    ),
    _engine(
        "worker_step_time_seconds", "histogram",
        "Wall time of one execute_model call on one tensor-parallel rank.", STEP_TIME_BUCKETS, extra=("rank",),
    ),
    _engine(
        "worker_failures", "counter", "Tensor-parallel worker actors found dead by their controller.",
        extra=("rank",),
    ),
    # vLLM's LoRA info gauge: its value is the time (Unix seconds) of the last update, its labels the adapter
    # names (comma-separated) of the running and waiting requests and max_loras. Only engines with enable_lora.
    _engine(
        "lora_requests_info", "gauge", "Running stats on lora requests.",
        extra=("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
    ),
    _engine("engine_healthy", "gauge", "1 while the engine can serve, 0 once it is dead (until Serve replaces it)."),
    # An info gauge in vLLM's way (vllm:cache_config_info): value 1, the engine's config as labels, set once at
    # start. `quantization` is what every rank runs (not the setting: a pre-quantized checkpoint picks fp8 by
    # itself), `dtype` the resolved one.
    _engine(
        "model_config_info", "gauge", "Information of the model's configuration as it runs.",
        extra=("quantization", "dtype"),
    ),
    MetricDef("raytp:batch_rows_total", "gauge", "Rows in the batch job's input file.", BATCH_LABELS),
    MetricDef(
        "raytp:batch_rows_done", "gauge", "Rows of the batch job answered so far (resumed ones included).",
        BATCH_LABELS,
    ),
    MetricDef("raytp:batch_rows_failed", "gauge", "Rows of the batch job that ended in an error.", BATCH_LABELS),
)  # fmt: skip

BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def metric(name: str) -> MetricDef:
    """The definition of `raytp:<name>` (or of `name` when it already carries the prefix)."""
    return BY_NAME[name if name.startswith("raytp:") else f"raytp:{name}"]


def exported_series() -> dict[str, tuple[str, ...]]:
    """Every sample name raytp exports (companion exact-sum counters included) -> its labels."""
    out: dict[str, tuple[str, ...]] = {}
    for m in METRICS:
        for d in (m, m.exact_sum):
            if d is not None:
                out.update({s: d.labels for s in d.samples})
    return out


# --- Ray Serve's own series that the dashboard and alerts use, as Ray 2.60 names and labels them ---
# (ray/serve/_private/request_ingress_metrics.py and deployment_state.py; tests check them live).
SERVE_SERIES: dict[str, tuple[str, ...]] = {
    "ray_serve_num_http_requests_total": ("route", "method", "application", "status_code"),
    "ray_serve_num_http_error_requests_total": ("route", "error_code", "method", "application"),
    "ray_serve_http_request_latency_ms_bucket": ("method", "route", "application", "status_code"),
    "ray_serve_http_request_latency_ms_sum": ("method", "route", "application", "status_code"),
    "ray_serve_http_request_latency_ms_count": ("method", "route", "application", "status_code"),
    "ray_serve_num_ongoing_http_requests": ("node_id", "node_ip_address"),
    "ray_serve_deployment_replica_healthy": ("deployment", "application"),
}

# Labels Ray adds to every application metric on a node's metrics port (Ray 2.60).
RAY_LABELS: tuple[str, ...] = ("Component", "NodeAddress", "SessionName", "Version", "WorkerId")
