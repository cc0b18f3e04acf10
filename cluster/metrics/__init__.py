"""raytp's metrics: one registry of definitions, typed stats, a Ray recorder, the /metrics page.

    registry.py     every metric once (name, type, help, labels, buckets); the Grafana dashboard and the
                    alert rules are generated from it at build time by tools/monitoring (not installed)
    stats.py        the records the engine fills per step and per finished request
    ray_metrics.py  EngineMetrics / WorkerMetrics / BatchMetrics: record into ray.util.metrics
    endpoint.py     application_metrics(): the text `GET /metrics` answers on the API port

No torch anywhere here; this package loads in the controller, the ingress, the workers and the
batch runner alike. Only ray_metrics.py and endpoint.py import Ray, and this file imports neither.
"""

from cluster.metrics.registry import METRICS, MetricDef, metric
from cluster.metrics.stats import BatchProgress, FinishedRequestStats, IterationStats, SchedulerStats

__all__ = [
    "METRICS",
    "BatchProgress",
    "FinishedRequestStats",
    "IterationStats",
    "MetricDef",
    "SchedulerStats",
    "metric",
]
