"""Monitoring objects carry the generated files unchanged, and the PodMonitors select the pods the
chart creates and scrape ports those pods declare."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import helm_python
import pytest
import yaml

from tests.k8s.chart import CHART_DIR, FILES_DIR, Obj, load_values, of_kind, one, pod_templates, render

DASHBOARD = FILES_DIR / "raytp-dashboard.json"
ALERTS = FILES_DIR / "raytp-alerts.yaml"
ALL_ON = {
    "monitoring": {
        "podMonitors": {"enabled": True},
        "dashboard": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "batch": {"enabled": True, "data": {"claimName": "batch-data"}},
}


def test_dashboard_configmap_holds_exactly_the_committed_dashboard() -> None:
    config_map = one(render(load_values("cpu-small")), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar watches
    assert config_map["data"] == {"raytp-dashboard.json": DASHBOARD.read_text()}
    assert json.loads(config_map["data"]["raytp-dashboard.json"])["panels"]


def test_dashboard_can_go_to_grafanas_namespace() -> None:
    values = {"monitoring": {"dashboard": {"enabled": True, "namespace": "monitoring", "sidecarLabel": "dash"}}}
    config_map = one(render(values), "ConfigMap")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["dash"] == "1"


def test_prometheus_rule_groups_equal_the_committed_alert_rules() -> None:
    rule = one(render(load_values("cpu-small")), "PrometheusRule")
    expected = yaml.safe_load(ALERTS.read_text())["groups"]
    assert expected and rule["spec"]["groups"] == expected


@pytest.mark.parametrize(
    ("switch", "message"),
    [("dashboard", "files/raytp-dashboard.json is missing"), ("prometheusRule", "files/raytp-alerts.yaml is missing")],
)
def test_a_missing_generated_file_fails_the_render(tmp_path: Path, switch: str, message: str) -> None:
    """Rather than deploy an empty dashboard or rule: a chart copied without files/ refuses to render."""
    shutil.copytree(CHART_DIR, tmp_path / "raytp", ignore=shutil.ignore_patterns("files"))
    with helm_python.Chart.load(tmp_path / "raytp") as bare, pytest.raises(helm_python.HelmError, match=message):
        bare.render({"monitoring": {switch: {"enabled": True}}}, name="raytp")


@pytest.mark.parametrize("kind", ["RayService", "RayJob"])
def test_pod_monitors_select_the_charts_pods_and_scrape_declared_ports(kind: str) -> None:
    objs = render(ALL_ON)
    monitors = {m["spec"]["selector"]["matchLabels"]["ray.io/node-type"]: m for m in of_kind(objs, "PodMonitor")}
    assert set(monitors) == {"head", "worker"}
    for role, template in pod_templates(one(objs, kind)):
        monitor: Obj = monitors[role]
        # KubeRay adds ray.io/node-type to each pod; every other selected label must be on the template.
        wanted = {k: v for k, v in monitor["spec"]["selector"]["matchLabels"].items() if k != "ray.io/node-type"}
        assert wanted.items() <= template["metadata"]["labels"].items(), (role, wanted)
        declared = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        scraped = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
        assert "metrics" in scraped and set(scraped) <= set(declared), (role, scraped, declared)
        # Ray exports its metrics (and raytp's, through Ray's pipeline) on the metrics-export-port.
        cluster = one(objs, kind)["spec"]
        spec = cluster["rayClusterConfig"] if kind == "RayService" else cluster["rayClusterSpec"]
        group = spec["headGroupSpec"] if role == "head" else spec["workerGroupSpecs"][0]
        assert int(group["rayStartParams"]["metrics-export-port"]) == declared["metrics"]


def test_pod_monitors_only_look_in_the_release_namespace() -> None:
    for monitor in of_kind(render(ALL_ON), "PodMonitor"):
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
