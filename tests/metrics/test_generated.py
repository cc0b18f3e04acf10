"""The generated dashboard and alert rules: fresh, valid, and naming only series that exist."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.metrics.registry import RAY_LABELS, SERVE_SERIES, exported_series
from tests.metrics.prom import PROMETHEUS_MISSING, PROMTOOL, promtool
from tests.metrics.promql import grouping_labels, matcher_labels, series_names, variables
from tools.monitoring import alerts, dashboard, generate

ROOT = Path(__file__).resolve().parents[2]
KNOWN: dict[str, tuple[str, ...]] = {**exported_series(), **SERVE_SERIES}
ALL_EXPRS = [t.expr for p in dashboard.PANELS for t in p.targets] + [r.expr for r in alerts.RULES]


def _committed_dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(generate.DASHBOARD_PATH.read_text())
    return loaded


def test_committed_dashboard_is_fresh() -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="the `test` extra's grafana-foundation-sdk regenerates it")
    from tools.monitoring.grafana import dashboard_json

    assert generate.DASHBOARD_PATH.read_text() == dashboard_json(), (
        "k8s/raytp/files/raytp-dashboard.json is stale: run `python -m tools.monitoring.generate` and commit it"
    )


def test_committed_alert_rules_are_fresh() -> None:
    assert generate.ALERTS_PATH.read_text() == alerts.rules_yaml(), (
        "k8s/raytp/files/raytp-alerts.yaml is stale: run `python -m tools.monitoring.generate` and commit it"
    )


@pytest.mark.parametrize("expr", ALL_EXPRS)
def test_expressions_name_only_exported_series_and_their_labels(expr: str) -> None:
    names = series_names(expr)
    assert names, f"no series found in {expr}"
    unknown = names - KNOWN.keys()
    assert not unknown, f"{expr} names series nothing exports: {sorted(unknown)}"
    for name, labels in matcher_labels(expr).items():
        assert labels <= set(KNOWN[name]), f"{name} has no label(s) {sorted(labels - set(KNOWN[name]))}"
    carried = {label for n in names for label in KNOWN[n]} | {"le"} | set(RAY_LABELS)
    assert grouping_labels(expr) <= carried, f"{expr} groups by labels its series lack"
    assert variables(expr) <= {"model_name", "replica", "__rate_interval"}


def test_dashboard_json_holds_exactly_the_spec_queries() -> None:
    board = _committed_dashboard()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert [p["title"] for p in panels] == [p.title for p in dashboard.PANELS]
    in_json = [(t["expr"], t["legendFormat"]) for p in panels for t in p["targets"]]
    assert in_json == [(t.expr, t.legend) for p in dashboard.PANELS for t in p.targets]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in panels)


def test_dashboard_variables() -> None:
    variables_ = {v["name"]: v for v in _committed_dashboard()["templating"]["list"]}
    assert list(variables_) == ["datasource", "model_name", "replica"]
    assert variables_["datasource"]["type"] == "datasource" and variables_["datasource"]["query"] == "prometheus"
    for name in ("model_name", "replica"):
        assert variables_[name]["includeAll"] and variables_[name]["allValue"] == ".*"
        assert series_names(variables_[name]["query"].removeprefix("label_values(").rsplit(",", 1)[0]) <= KNOWN.keys()


def test_dashboard_has_the_panels_issue_11_asks_for() -> None:
    titles = {p.title for p in dashboard.PANELS}
    wanted = {
        "E2E request latency",
        "Time to first token",
        "Inter-token latency",
        "Token throughput",
        "Scheduler state",
        "KV cache usage",
        "Queue time",
        "Prefill and decode time",
        "Prompt length",
        "Generation length",
        "Finish reasons",
        "Preemptions",
        "Prefix cache hit rate",
        "HTTP request rate by status code",
        "HTTP error rate by status code",
        "Engine step time per replica",
        "Worker step time per rank",
        "Batch job rows",
    }
    assert wanted <= titles, sorted(wanted - titles)
    for title in ("E2E request latency", "Time to first token", "Inter-token latency"):
        panel = next(p for p in dashboard.PANELS if p.title == title)
        assert [t.legend for t in panel.targets] == ["p99", "p95", "p90", "p50", "mean"]
        # The mean divides the exact-sum counter, not Ray's midpoint-approximated _sum.
        assert "_sum_exact_total" in panel.targets[-1].expr and "_sum{" not in panel.targets[-1].expr


def test_substitute_fills_every_variable() -> None:
    for expr in ALL_EXPRS:
        assert "$" not in dashboard.substitute(expr)


@pytest.mark.skipif(PROMTOOL is None, reason=PROMETHEUS_MISSING)
def test_promtool_accepts_the_alert_rules() -> None:
    proc = promtool("check", "rules", str(generate.ALERTS_PATH))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts.RULES)} rules found" in proc.stdout


@pytest.mark.skipif(PROMTOOL is None, reason=PROMETHEUS_MISSING)
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-api.yml"])
def test_promtool_accepts_the_ready_made_prometheus_configs(config: str) -> None:
    proc = promtool("check", "config", str(ROOT / "k8s" / "prometheus" / config))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alert_rules_cover_issue_11() -> None:
    by_name = {r.alert: r for r in alerts.RULES}
    assert "worker_failures" in by_name["RaytpWorkerFailed"].expr
    assert "engine_healthy" in by_name["RaytpEngineUnhealthy"].expr
    kv = by_name["RaytpKVCacheFull"]
    assert "kv_cache_usage_perc" in kv.expr and "> 0.95" in kv.expr and kv.for_ == "5m"
    assert "num_requests_waiting" in by_name["RaytpWaitingQueueGrowing"].expr
    assert "histogram_quantile(0.99" in by_name["RaytpHighTimeToFirstToken"].expr
