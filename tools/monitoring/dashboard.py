"""The Grafana dashboard's panels and queries, written against the registry (no Grafana SDK here).

Every query is built from `registry.metric(...)` definitions, so it can only name a series the
recorder exports; `grafana.py` renders these specs into dashboard JSON, the PNG preview and the
live Prometheus tests evaluate the same expressions. Grafana variables in the queries:
`$model_name` and `$replica` (multi-value regexes, "All" = `.*`) and `$__rate_interval`.

Panels follow vLLM's example dashboard (E2E latency, TTFT, ITL as p50/p90/p95/p99 and mean; token
throughput; scheduler state; KV cache usage; queue / prefill / decode time; prompt and generation
length heatmaps; finish reasons; preemptions; prefix-cache hit rate), then Ray Serve's HTTP
traffic and what only raytp shows (per-replica and per-rank step time, worker failures, engine
health, batch job progress), and speculative decoding's acceptance (vLLM's spec_decode counters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cluster.metrics.registry import MetricDef, metric

PanelKind = Literal["timeseries", "heatmap"]
# Which workload fills a panel: "engine" any served request, "serve" HTTP traffic through Ray
# Serve (errors need a failed request), "worker" the Ray executor's TP workers, "batch" a running
# batch job, "spec" an engine with a speculative_config. The live test picks the panels its workload can fill.
Source = Literal["engine", "serve", "worker", "batch", "spec"]

RATE = "$__rate_interval"
ENGINE_SELECTOR = 'model_name=~"$model_name", replica=~"$replica"'
BATCH_SELECTOR = 'model_name=~"$model_name"'
QUANTILES = (0.5, 0.9, 0.95, 0.99)


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str  # a Grafana unit id: s, ms, short, percentunit, reqps, ...
    targets: tuple[Target, ...]
    source: Source = "engine"
    kind: PanelKind = "timeseries"


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _sel(m: MetricDef, sample: str | None = None) -> str:
    name = sample or m.samples[0]
    return f"{name}{{{BATCH_SELECTOR if 'batch_job' in m.labels else ENGINE_SELECTOR}}}"


def _rate(m: MetricDef, by: str = "", sample: str | None = None) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({_sel(m, sample)}[{RATE}]))"


def quantile(q: float, m: MetricDef, by: str = "") -> str:
    return f"histogram_quantile({q}, {_rate(m, ', '.join(['le', by]) if by else 'le', f'{m.series}_bucket')})"


def mean(m: MetricDef, by: str = "") -> str:
    """Exact mean over the interval: the exact-sum counter over the histogram's count."""
    exact = m.exact_sum
    assert exact is not None, f"{m.name} is not a histogram"
    return f"{_rate(exact, by)} / {_rate(m, by, f'{m.series}_count')}"


def _latency(title: str, name: str, description: str, unit: str = "s") -> Panel:
    m = metric(name)
    targets = [Target(quantile(q, m), f"p{round(q * 100)}") for q in reversed(QUANTILES)]
    return Panel(title, description, unit, (*targets, Target(mean(m), "mean")))


def _heatmap(title: str, name: str, description: str) -> Panel:
    m = metric(name)
    expr = f"sum by (le) (increase({_sel(m, f'{m.series}_bucket')}[{RATE}]))"
    return Panel(title, description, "short", (Target(expr, "{{le}}"),), kind="heatmap")


# Serve's own endpoints (/-/healthz, /-/routes): behind HAProxy the ingress replica books HAProxy's
# health checks of it as requests (raytp.serve.args.SERVE_ENV_DEFAULTS); the panels show the API's traffic.
API_ROUTES = 'route!~"/-/.*"'


def _serve() -> Row:
    by_status = f"sum by (status_code) (rate(ray_serve_num_http_requests_total{{{API_ROUTES}}}[$__rate_interval]))"
    by_error = f"sum by (error_code) (rate(ray_serve_num_http_error_requests_total{{{API_ROUTES}}}[$__rate_interval]))"
    latency = f"sum by (le) (rate(ray_serve_http_request_latency_ms_bucket{{{API_ROUTES}}}[$__rate_interval]))"
    return Row(
        "HTTP (Ray Serve)",
        (
            Panel(
                "HTTP request rate by status code",
                "Requests to the API, as its ingress replicas answered them (Serve's /-/ endpoints left out).",
                "reqps",
                (Target(by_status, "{{status_code}}"),),
                "serve",
            ),
            Panel(
                "HTTP error rate by status code",
                "Responses with an error status, by code.",
                "reqps",
                (Target(by_error, "{{error_code}}"),),
                "serve",
            ),
            Panel(
                "HTTP request latency",
                "Latency of the API's requests, as the ingress replicas measure it.",
                "ms",
                tuple(Target(f"histogram_quantile({q}, {latency})", f"p{round(q * 100)}") for q in (0.5, 0.99)),
                "serve",
            ),
            Panel(
                "Ongoing HTTP requests",
                "Requests in flight in the ingress replicas.",
                "short",
                (Target("sum(ray_serve_num_ongoing_http_requests)", "ongoing"),),
                "serve",
            ),
        ),
    )


def _latency_row() -> Row:
    return Row(
        "Latency",
        (
            _latency("E2E request latency", "e2e_request_latency_seconds", "Arrival to the last token."),
            _latency("Time to first token", "time_to_first_token_seconds", "Arrival to the first token."),
            _latency("Inter-token latency", "inter_token_latency_seconds", "Between two tokens of a sequence."),
        ),
    )


def _load_row() -> Row:
    running, waiting, swapped = (
        metric(n) for n in ("num_requests_running", "num_requests_waiting", "num_requests_swapped")
    )
    kv = metric("kv_cache_usage_perc")
    step_tokens = metric("iteration_tokens_total")
    return Row(
        "Throughput and load",
        (
            Panel(
                "Token throughput",
                "Prompt tokens prefilled and tokens generated per second.",
                "short",
                (
                    Target(_rate(metric("prompt_tokens")), "prompt tokens/s"),
                    Target(_rate(metric("generation_tokens")), "generation tokens/s"),
                ),
            ),
            Panel(
                "Scheduler state",
                "Requests in the running, waiting and swapped queues.",
                "short",
                (
                    Target(f"sum({_sel(running)})", "running"),
                    Target(f"sum({_sel(waiting)})", "waiting"),
                    Target(f"sum({_sel(swapped)})", "swapped"),
                ),
            ),
            Panel(
                "KV cache usage",
                "Share of device KV blocks in use, per replica.",
                "percentunit",
                (Target(f"max by (replica) ({_sel(kv)})", "{{replica}}"),),
            ),
            Panel(
                "Tokens per engine step",
                "Prompt plus generated tokens one engine step processed.",
                "short",
                (
                    Target(quantile(0.5, step_tokens), "p50"),
                    Target(quantile(0.99, step_tokens), "p99"),
                    Target(mean(step_tokens), "mean"),
                ),
            ),
        ),
    )


def _phases_row() -> Row:
    queue, prefill, decode = (
        metric(n) for n in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
    )
    return Row(
        "Request phases",
        (
            Panel(
                "Queue time",
                "Arrival to first scheduled (WAITING).",
                "s",
                (
                    Target(quantile(0.5, queue), "p50"),
                    Target(quantile(0.99, queue), "p99"),
                    Target(mean(queue), "mean"),
                ),
            ),
            Panel(
                "Prefill and decode time",
                "First scheduled to first token (prefill); first to last token (decode).",
                "s",
                (
                    Target(mean(prefill), "prefill mean"),
                    Target(quantile(0.99, prefill), "prefill p99"),
                    Target(mean(decode), "decode mean"),
                    Target(quantile(0.99, decode), "decode p99"),
                ),
            ),
        ),
    )


def _requests_row() -> Row:
    hits, queries = metric("prefix_cache_hits"), metric("prefix_cache_queries")
    return Row(
        "Requests",
        (
            Panel(
                "Finish reasons",
                "Finished requests per second, by finish reason.",
                "reqps",
                (Target(_rate(metric("request_success"), "finished_reason"), "{{finished_reason}}"),),
            ),
            Panel(
                "Preemptions",
                "Requests preempted per second (recompute or swap), per replica.",
                "short",
                (Target(_rate(metric("num_preemptions"), "replica"), "{{replica}}"),),
            ),
            Panel(
                "Prefix cache hit rate",
                "Share of queried prompt tokens found in the prefix cache.",
                "percentunit",
                (Target(f"{_rate(hits)} / {_rate(queries)}", "hit rate"),),
            ),
            _heatmap("Prompt length", "request_prompt_tokens", "Prompt tokens per finished request."),
            _heatmap("Generation length", "request_generation_tokens", "Generated tokens per finished request."),
            _heatmap("Requested max_tokens", "request_params_max_tokens", "max_tokens of finished requests."),
            _heatmap("Requested n", "request_params_n", "n (sequences per request) of finished requests."),
        ),
    )


def _replicas_row() -> Row:
    step, rank_step = metric("engine_step_time_seconds"), metric("worker_step_time_seconds")
    failures, healthy = metric("worker_failures"), metric("engine_healthy")
    return Row(
        "Replicas and ranks",
        (
            Panel(
                "Engine step time per replica",
                "Wall time of one engine step in each replica's controller.",
                "s",
                (
                    Target(quantile(0.5, step, "replica"), "{{replica}} p50"),
                    Target(quantile(0.99, step, "replica"), "{{replica}} p99"),
                ),
            ),
            Panel(
                "Worker step time per rank",
                "Wall time of execute_model on each tensor-parallel rank; a slow rank holds back its replica.",
                "s",
                (
                    Target(mean(rank_step, "replica, rank"), "{{replica}} rank {{rank}} mean"),
                    Target(quantile(0.99, rank_step, "replica, rank"), "{{replica}} rank {{rank}} p99"),
                ),
                "worker",
            ),
            Panel(
                "Worker failures",
                "TP workers found dead in the interval, per replica and rank.",
                "short",
                (Target(f"sum by (replica, rank) (increase({_sel(failures)}[{RATE}]))", "{{replica}} rank {{rank}}"),),
                "worker",
            ),
            Panel(
                "Engine health",
                "1 while a replica's engine can serve, 0 once it is dead.",
                "short",
                (Target(f"min by (replica) ({_sel(healthy)})", "{{replica}}"),),
            ),
        ),
    )


def _spec_row() -> Row:
    drafts, drafted, accepted, per_pos = (
        metric(f"spec_decode_{n}")
        for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    )
    # A position's rate is over all drafts (a draft shorter than k has not accepted the positions it lacks).
    by_position = f"{_rate(per_pos, 'position')} / ignoring(position) group_left {_rate(drafts)}"
    return Row(
        "Speculative decoding",
        (
            Panel(
                "Speculative decoding: acceptance rate",
                "Share of proposed tokens the target model accepted; per position: drafts whose proposal there "
                "was accepted.",
                "percentunit",
                (
                    Target(f"{_rate(accepted)} / {_rate(drafted)}", "acceptance rate"),
                    Target(by_position, "position {{position}}"),
                ),
                "spec",
            ),
            Panel(
                "Speculative decoding: mean acceptance length",
                "Tokens one speculative row yields per step: its accepted proposals plus the target's own token.",
                "short",
                (Target(f"1 + {_rate(accepted)} / {_rate(drafts)}", "mean acceptance length"),),
                "spec",
            ),
        ),
    )


def _batch_row() -> Row:
    total, done, failed = (metric(n) for n in ("batch_rows_total", "batch_rows_done", "batch_rows_failed"))
    return Row(
        "Batch jobs",
        (
            Panel(
                "Batch job rows",
                "Rows in the input, answered so far, and failed, per job.",
                "short",
                (
                    Target(f"sum by (batch_job) ({_sel(total)})", "{{batch_job}} total"),
                    Target(f"sum by (batch_job) ({_sel(done)})", "{{batch_job}} done"),
                    Target(f"sum by (batch_job) ({_sel(failed)})", "{{batch_job}} failed"),
                ),
                "batch",
            ),
            Panel(
                "Batch job completion",
                "Share of each job's rows answered.",
                "percentunit",
                (Target(f"sum by (batch_job) ({_sel(done)}) / sum by (batch_job) ({_sel(total)})", "{{batch_job}}"),),
                "batch",
            ),
        ),
    )


ROWS: tuple[Row, ...] = (
    _serve(),
    _latency_row(),
    _load_row(),
    _phases_row(),
    _requests_row(),
    _replicas_row(),
    _spec_row(),
    _batch_row(),
)
PANELS: tuple[Panel, ...] = tuple(p for row in ROWS for p in row.panels)

# The dashboard's template variables: name -> the query listing its values.
VARIABLES: dict[str, str] = {
    "model_name": f"label_values({metric('num_requests_running').series}, model_name)",
    "replica": f'label_values({metric("num_requests_running").series}{{model_name=~"$model_name"}}, replica)',
}


def substitute(expr: str, rate_interval: str = "1m", model_name: str = ".*", replica: str = ".*") -> str:
    """The query as Grafana sends it, for evaluating outside Grafana (default: "All" selected)."""
    return (
        expr.replace("$__rate_interval", rate_interval).replace("$model_name", model_name).replace("$replica", replica)
    )
