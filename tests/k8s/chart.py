"""The Helm chart in k8s/raytp rendered by Helm's own Go engine (helm-python-sdk binds libhelm; no
helm binary), and small readers for what it renders. Offline: no cluster is contacted."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "k8s" / "raytp"
FILES_DIR = CHART_DIR / "files"
CI_VALUES = {p.name.removesuffix("-values.yaml"): p for p in sorted((CHART_DIR / "ci").glob("*-values.yaml"))}
INVALID_VALUES = Path(__file__).resolve().parent / "invalid-values.yaml"
# The published CRDs (RayService, RayJob, PodMonitor, PrometheusRule) live beside the repository.
CRDS_DIR = ROOT.parent / "shared" / "crds"
# Manifests are checked against this Kubernetes release's API (kubernetes-validate ships its schemas).
KUBERNETES_VERSION = "1.33.0"
RELEASE, NAMESPACE = "raytp", "llm"

Obj = dict[str, Any]


def load_values(name: str) -> dict[str, Any]:
    """A ci values file by short name ("cpu-small"...), or "default" for the chart's own values only."""
    if name == "default":
        return {}
    loaded = yaml.safe_load(CI_VALUES[name].read_text())
    assert isinstance(loaded, dict), f"{CI_VALUES[name]} is not a mapping"
    return loaded


@functools.cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART_DIR)


def merged_values(values: dict[str, Any]) -> dict[str, Any]:
    """The values an install would use: the chart's defaults coalesced with `values`."""
    return chart().merge_values(values)


def render_files(values: dict[str, Any], release: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would produce (schema checked first)."""
    return chart().render(values, name=release, namespace=NAMESPACE, is_install=True)


def render(values: dict[str, Any], release: str = RELEASE) -> list[Obj]:
    """Every object the chart renders for `values` (NOTES.txt excluded)."""
    objs: list[Obj] = []
    for path, text in sorted(render_files(values, release).items()):
        if path.endswith("NOTES.txt"):
            continue
        objs += [doc for doc in yaml.safe_load_all(text) if doc]
    return objs


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[Obj], kind: str) -> Obj:
    found = of_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def cluster_spec(obj: Obj) -> Obj:
    """The RayCluster spec inside a RayService or a RayJob."""
    return obj["spec"]["rayClusterConfig"] if obj["kind"] == "RayService" else obj["spec"]["rayClusterSpec"]


def pod_templates(obj: Obj) -> Iterator[tuple[str, Obj]]:
    """(node type as KubeRay labels it: head | worker, pod template) of a RayService or RayJob."""
    spec = cluster_spec(obj)
    yield "head", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield "worker", group["template"]


def serve_config(objs: list[Obj]) -> dict[str, Any]:
    config = yaml.safe_load(one(objs, "RayService")["spec"]["serveConfigV2"])
    assert isinstance(config, dict)
    return config


def container_env(template: Obj) -> dict[str, Any]:
    """name -> value or valueFrom of the Ray container (the first, as KubeRay requires)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in template["spec"]["containers"][0].get("env", [])}
