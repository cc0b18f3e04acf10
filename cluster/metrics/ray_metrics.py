"""Record raytp's stats into Ray's metrics pipeline (ray.util.metrics), tagged by model and replica.

Every process that owns a fact records it where it is, and Ray's per-node metrics agent exports
it on that node's metrics port beside Ray Serve's `ray_serve_*` series (names: registry.py):

    EngineMetrics(model_name, replica)         controller / output path: scheduler + iteration stats, health,
                                               info gauges (`record_info`)
    WorkerMetrics(model_name, replica, rank)   each TP worker: its execute_model wall time
    BatchMetrics(model_name, batch_job)        the batch runner: rows total / done / failed

How Ray 2.60 behaves, and what this module does about it (each checked in tests/metrics):
- A recorded value reaches the node's metrics port after one export interval
  (RAY_metrics_report_interval_ms, 10 s by default); nothing is exported before the first record.
- A counter cannot be incremented by 0, so a counter nobody incremented yet has no series and its
  panel would be blank. Each recorder creates its counters at 0 on first use (as vLLM's
  `.labels()` does), including request_success for every finish reason.
- A gauge that is not set again within two export intervals is dropped from the export. A
  daemon thread per process re-sets every live gauge value each `GAUGE_REFRESH_S`, so an idle
  engine still shows 0 running requests; `close()` stops refreshing a recorder's gauges.
- A histogram's `_sum` is rebuilt from bucket midpoints; each histogram therefore has a companion
  counter `<name>_sum_exact` incremented by the exact value (registry.MetricDef.exact_sum).

Instruments are created once per process, lazily, from the registry; recording costs one
`ray.util.metrics` call per value (plus one for a histogram's exact sum).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping

from ray.util import metrics as ray_metrics

from cluster.metrics.registry import FINISH_REASONS, METRICS, MetricDef, metric
from cluster.metrics.stats import BatchProgress, IterationStats, LoRAStats, SchedulerStats

Tags = dict[str, str]  # passed to Ray as is: Ray merges it into a new dict and never mutates it

# How often live gauges are re-set. It must stay below Ray's gauge time-to-live, which is two
# export intervals of at least 1 s each; re-setting a handful of gauges once a second is free.
GAUGE_REFRESH_S = 1.0

_instruments: dict[str, ray_metrics.Metric] = {}
_instruments_lock = threading.Lock()


def _instrument(d: MetricDef) -> ray_metrics.Metric:
    """The process's one Ray instrument for `d` (Ray wants one object per name and process)."""
    with _instruments_lock:
        inst = _instruments.get(d.name)
        if inst is None:
            if d.kind == "counter":
                inst = ray_metrics.Counter(d.ray_name, description=d.help, tag_keys=d.labels)
            elif d.kind == "gauge":
                inst = ray_metrics.Gauge(d.ray_name, description=d.help, tag_keys=d.labels)
            else:
                inst = ray_metrics.Histogram(
                    d.ray_name, description=d.help, boundaries=list(d.buckets), tag_keys=d.labels
                )
            _instruments[d.name] = inst
        return inst


def _count(d: MetricDef, value: float, tags: Tags) -> None:
    if value < 0:
        raise ValueError(f"{d.name} is a counter: cannot add {value}")
    if value > 0:  # Ray refuses inc(0); a zero adds nothing anyway
        _instrument(d).inc(value, tags=tags)  # type: ignore[attr-defined]


def _zero(d: MetricDef, tags: Tags) -> None:
    """Make counter `d`'s series exist at 0. Ray's public inc() refuses 0, but its recording path
    accepts it and then exports the series at 0 (tests/metrics/test_ray_recorder.py checks that)."""
    _instrument(d)._record(0.0, tags=tags)


def _observe(d: MetricDef, values: Iterable[float], tags: Tags) -> None:
    observe = _instrument(d).observe  # type: ignore[attr-defined]
    exact = d.exact_sum
    assert exact is not None, f"{d.name} is not a histogram"
    total = 0.0
    for v in values:
        if v < 0:
            raise ValueError(f"{d.name}: observations are durations or counts, got {v}")
        observe(v, tags=tags)
        total += v
    _count(exact, total, tags)


class _GaugeKeeper:
    """Holds the last value of every live gauge series in this process and re-sets them all every
    GAUGE_REFRESH_S from a daemon thread, which runs only while some gauge is live."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def set(self, d: MetricDef, tags: Mapping[str, str], value: float) -> None:
        # Set under the lock so a refresh can never write an older value after a newer one.
        with self._lock:
            self._live[(d.name, frozenset(tags.items()))] = value
            _instrument(d).set(value, tags=dict(tags))  # type: ignore[attr-defined]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="raytp-gauge-keeper", daemon=True)
                self._thread.start()

    def forget(self, tags: Mapping[str, str]) -> None:
        """Stop refreshing every series whose labels include all of `tags` (Ray then ages them out)."""
        items = set(tags.items())
        with self._lock:
            for key in [k for k in self._live if items <= k[1]]:
                del self._live[key]

    def _run(self) -> None:
        while True:
            self._wake.wait(GAUGE_REFRESH_S)
            with self._lock:
                if not self._live:
                    self._thread = None  # the next set() starts a fresh thread
                    return
                for (name, tags), value in self._live.items():
                    _instrument(metric(name)).set(value, tags=dict(tags))  # type: ignore[attr-defined]


_keeper = _GaugeKeeper()

_SUCCESS = metric("request_success")
_LORA_INFO = metric("lora_requests_info")
_SPEC_PER_POS = metric("spec_decode_num_accepted_tokens_per_pos")


def _sourced(record: str) -> tuple[tuple[MetricDef, str], ...]:
    """The metrics read from one stats record (their registry `source`), each with the field it reads."""
    prefix = f"{record}."
    return tuple((d, d.source.removeprefix(prefix)) for d in METRICS if d.source.startswith(prefix))


_FROM_SCHEDULER = _sourced("scheduler")
_FROM_ITERATION = _sourced("iteration")
_FROM_SPEC = _sourced("spec_decoding")
_FROM_FINISHED = _sourced("finished")


def _record_fields(metrics: tuple[tuple[MetricDef, str], ...], record: object, tags: Tags) -> None:
    """Each metric from its field of `record`, as its kind records a value."""
    for d, field in metrics:
        value = float(getattr(record, field))
        if d.kind == "gauge":
            _keeper.set(d, tags, value)
        elif d.kind == "counter":
            _count(d, value, tags)
        else:
            _observe(d, (value,), tags)


def _zero_counters(metrics: tuple[tuple[MetricDef, str], ...], tags: Tags) -> None:
    for d, _ in metrics:
        if d.kind == "counter":
            _zero(d, tags)


class EngineMetrics:
    """One model replica's engine metrics, recorded in the process that calls it.

    The scheduler-state gauges and the prefix-cache counters come from `record_scheduler_stats`
    (the controller, which owns the scheduler and the block manager); the token counters, TTFT,
    ITL and the finished-request histograms come from `record_iteration_stats` (wherever tokens
    reach their requests). The two may be called from different processes, each with its own
    EngineMetrics for the same (model_name, replica): Prometheus sums the per-process series.
    """

    def __init__(self, model_name: str, replica: str, num_ranks: int = 0, num_speculative_tokens: int = 0) -> None:
        """num_ranks: the controller passes its TP size, which creates each rank's failure counter
        at 0 (so the dashboard lists every rank and increase() sees the first failure).
        num_speculative_tokens: k of the engine's speculative_config (0: none); the spec_decode counters,
        one per position included, exist (at 0) only when it is set, as vLLM creates them."""
        self._tags = {"model_name": model_name, "replica": replica}
        self._position_tags = [{**self._tags, "position": str(i)} for i in range(num_speculative_tokens)]
        if num_speculative_tokens:
            _zero_counters(_FROM_SPEC, self._tags)
            for tags in self._position_tags:
                _zero(_SPEC_PER_POS, tags)
        self._scheduler_started = False
        self._iteration_started = False
        self._lora_tags: dict[str, str] | None = None  # the lora_requests_info series set last
        for rank in range(num_ranks):
            _zero(metric("worker_failures"), {**self._tags, "rank": str(rank)})

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        if not self._scheduler_started:
            self._scheduler_started = True
            _zero_counters(_FROM_SCHEDULER, self._tags)
        _record_fields(_FROM_SCHEDULER, stats, self._tags)
        if stats.lora is not None:
            self._record_lora(stats.lora)

    def _record_lora(self, lora: LoRAStats) -> None:
        """vLLM's way: one live series, labelled with the adapters, set to the current time. The series of
        the previous label set stops being refreshed, so Ray ages it out."""
        tags = {
            **self._tags,
            "running_lora_adapters": ",".join(lora.running_adapters),
            "waiting_lora_adapters": ",".join(lora.waiting_adapters),
            "max_lora": str(lora.max_lora),
        }
        if self._lora_tags is not None and self._lora_tags != tags:
            _keeper.forget(self._lora_tags)
        self._lora_tags = tags
        _keeper.set(_LORA_INFO, tags, time.time())

    def record_iteration_stats(self, stats: IterationStats) -> None:
        tags = self._tags
        spec = stats.spec_decoding
        if spec is not None and len(spec.num_accepted_tokens_per_pos) != len(self._position_tags):
            raise ValueError(
                f"{len(spec.num_accepted_tokens_per_pos)} draft positions recorded, "
                f"the recorder was made for num_speculative_tokens={len(self._position_tags)}"
            )
        if not self._iteration_started:
            self._iteration_started = True
            _zero_counters(_FROM_ITERATION, tags)
            for reason in FINISH_REASONS:
                _zero(_SUCCESS, {**tags, "finished_reason": reason})
        _record_fields(_FROM_ITERATION, stats, tags)
        if stats.num_scheduled_tokens > 0:  # an idle step is not an iteration
            _observe(metric("iteration_tokens_total"), (stats.num_scheduled_tokens,), tags)
        if stats.time_to_first_tokens:
            _observe(metric("time_to_first_token_seconds"), stats.time_to_first_tokens, tags)
        if stats.inter_token_latencies:
            _observe(metric("inter_token_latency_seconds"), stats.inter_token_latencies, tags)
        if stats.step_time is not None:
            _observe(metric("engine_step_time_seconds"), (stats.step_time,), tags)
        if spec is not None:
            _record_fields(_FROM_SPEC, spec, tags)
            for position_tags, accepted in zip(self._position_tags, spec.num_accepted_tokens_per_pos, strict=True):
                _count(_SPEC_PER_POS, accepted, position_tags)
        for req in stats.finished_requests:
            _count(_SUCCESS, 1, {**tags, "finished_reason": req.finish_reason})
            _record_fields(_FROM_FINISHED, req, tags)
            if req.max_tokens_param is not None:
                _observe(metric("request_params_max_tokens"), (float(req.max_tokens_param),), tags)

    def record_worker_failure(self, rank: int) -> None:
        """A TP worker actor of this replica was found dead (the controller calls this)."""
        _count(metric("worker_failures"), 1, {**self._tags, "rank": str(rank)})

    def record_health(self, healthy: bool) -> None:
        """1 once the engine serves, 0 once it is dead; kept until close() or the process ends."""
        _keeper.set(metric("engine_healthy"), self._tags, 1.0 if healthy else 0.0)

    def record_info(self, name: str, labels: Mapping[str, str]) -> None:
        """Set info gauge `name` (vLLM's `*_info`: value 1, facts as labels) for this replica, kept exported until
        close(). `labels` must be exactly the labels the registry gives it beyond the engine's (ValueError)."""
        d = metric(name)
        engine, extra = d.labels[: len(self._tags)], d.labels[len(self._tags) :]
        info = d.kind == "gauge" and d.name.endswith("_info") and engine == tuple(self._tags) and bool(extra)
        if not info or set(labels) != set(extra):
            raise ValueError(f"{d.name} is not an engine info gauge with labels {sorted(labels)}")
        _keeper.set(d, {**self._tags, **labels}, 1.0)

    def close(self) -> None:
        """Stop refreshing this replica's gauges; Ray drops them within two export intervals."""
        _keeper.forget(self._tags)


class WorkerMetrics:
    """One tensor-parallel rank's metrics, recorded in its worker process."""

    def __init__(self, model_name: str, replica: str, rank: int) -> None:
        self._tags = {"model_name": model_name, "replica": replica, "rank": str(rank)}

    def record_step(self, seconds: float) -> None:
        _observe(metric("worker_step_time_seconds"), (seconds,), self._tags)


class BatchMetrics:
    """A batch job's progress, recorded by the process that drives the job."""

    def __init__(self, model_name: str, batch_job: str) -> None:
        self._tags = {"model_name": model_name, "batch_job": batch_job}

    def record_progress(self, progress: BatchProgress) -> None:
        _keeper.set(metric("batch_rows_total"), self._tags, float(progress.rows_total))
        _keeper.set(metric("batch_rows_done"), self._tags, float(progress.rows_done))
        _keeper.set(metric("batch_rows_failed"), self._tags, float(progress.rows_failed))

    def close(self) -> None:
        """Stop refreshing the job's gauges (call when the job ends; they then age out)."""
        _keeper.forget(self._tags)
