"""EngineTelemetry: what the controller records, and when, in one place.

The controller calls it at four moments of a request's and a step's life; it turns the engine's
state and the published deltas into stats records (`EngineStatsCollector`) and hands them to
Ray's metrics pipeline (`EngineMetrics`), tagged with the model and the replica:

    on_add(request)          remember the request's arrival, n and max_tokens
    on_publish(deltas, ...)  after every step (and for final deltas between steps): tokens, TTFT,
                             ITL, finished requests, step time; after a step also queues and KV
    on_idle()                the step loop stopped: the gauges show the idle state
    on_failure(error)        the engine died: health 0, and the failed rank's counter +1

At start it sets the info gauge `raytp:model_config_info` (the quantization the ranks run, the dtype) once;
the recorder keeps it exported until close().

The same records feed the periodic log lines (`cluster/metrics/log_stats.py`: throughput, queues, KV,
and with speculative decoding vLLM's SpecDecoding line), written after a step or on idle once due.

Everything runs on the controller's event loop thread, between steps; nothing here blocks.
The controller builds none of this when the engine config says `disable_log_stats`.
"""

from __future__ import annotations

import time

from cluster.engine import LLMEngine
from cluster.engine_stats import EngineStatsCollector
from cluster.metrics.log_stats import StatsLogger
from cluster.metrics.ray_metrics import EngineMetrics
from cluster.metrics.stats import IterationStats
from cluster.outputs import RequestDelta
from cluster.ray_executor import RankFailedError
from request.sampling_params import SamplingParams
from scheduler.outputs import SchedulerOutput


class EngineTelemetry:
    def __init__(self, engine: LLMEngine, replica: str, model_name: str) -> None:
        self._stats = EngineStatsCollector(engine.scheduler, engine.block_manager, engine.loras)
        spec = engine.scheduler.config.speculative
        k = spec.num_speculative_tokens if spec is not None else 0
        self._metrics = EngineMetrics(
            model_name, replica, num_ranks=engine.config.tensor_parallel_size, num_speculative_tokens=k
        )
        self._log = StatsLogger(model_name, num_speculative_tokens=k)
        engine.executor.collective_rpc("start_metrics", model_name, replica, timeout_s=10.0)  # each rank its step time
        # Every gauge and counter exists (at 0) before the first request, so increase() sees its first rise.
        self._metrics.record_scheduler_stats(self._stats.scheduler_stats())
        self._metrics.record_iteration_stats(IterationStats())
        self._metrics.record_health(True)
        self._metrics.record_info(
            "model_config_info", {"quantization": engine.quantization, "dtype": engine.config.dtype}
        )

    def on_add(self, request_id: str, params: SamplingParams, arrival_time: float) -> None:
        self._stats.add_request(request_id, params, arrival_time)

    def on_publish(self, deltas: list[RequestDelta], so: SchedulerOutput | None = None, start: float = 0.0) -> None:
        """With `so`: the deltas of the step that began at `start` (time.monotonic()); without: final
        deltas published between steps (aborts). An empty step ran nothing and has no step time."""
        now = time.monotonic()
        step_time = now - start if so is not None and not so.is_empty else None
        iteration = self._stats.iteration_stats(deltas, now, so, step_time)
        self._metrics.record_iteration_stats(iteration)
        self._log.observe_iteration(iteration)
        if so is not None:
            self._record_scheduler()
        self._log.maybe_log(now)

    def on_idle(self) -> None:
        # The recorder keeps re-exporting these last values until the next step.
        self._record_scheduler()
        self._log.maybe_log()

    def _record_scheduler(self) -> None:
        stats = self._stats.scheduler_stats()
        self._metrics.record_scheduler_stats(stats)
        self._log.observe_scheduler(stats)

    def on_failure(self, error: BaseException) -> None:
        if isinstance(error, RankFailedError) and error.rank is not None:
            self._metrics.record_worker_failure(error.rank)
        self._metrics.record_health(False)

    def close(self) -> None:
        """Stop exporting this replica's gauges (a replacement replica has its own)."""
        self._metrics.close()
