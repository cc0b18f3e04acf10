"""The chart renders with Helm's engine for every kept values file, lints clean, and its schema refuses
mistaken values with a message that names each mistake."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import tomllib
from typing import Any

import helm_python
import pytest
import ray

from cluster.config import EngineConfig
from tests.k8s.chart import (
    CHART_DIR,
    CI_VALUES,
    INVALID_VALUES,
    KUBERNETES_VERSION,
    ROOT,
    load_values,
    merged_values,
    of_kind,
    render,
    render_files,
)

SETUPS = ["default", *CI_VALUES]
ERROR, WARNING = 3, 2  # helm lint severities


def test_the_three_required_setups_are_kept_in_the_chart() -> None:
    assert {"cpu-small", "gpu-tp2", "batch"} <= set(CI_VALUES)


@pytest.mark.parametrize("setup", SETUPS)
def test_lint_is_clean(setup: str) -> None:
    report = helm_python.lint(CHART_DIR, load_values(setup), strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    bad = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert not bad and not report["errors"], bad or report["errors"]


@pytest.mark.parametrize("setup", SETUPS)
def test_renders_what_the_switches_ask_for(setup: str) -> None:
    values = merged_values(load_values(setup))
    objs = render(load_values(setup))
    mon = values["monitoring"]
    hf_cache_created = (
        values["model"]["source"] == "huggingface" and values["model"]["huggingface"]["cache"]["create"]["enabled"]
    )
    expected = {
        "RayService": int(values["rayService"]["enabled"]),
        "RayJob": int(values["batch"]["enabled"]),
        "PodMonitor": 2 * int(mon["podMonitors"]["enabled"]),
        "ConfigMap": int(mon["dashboard"]["enabled"]),
        "PrometheusRule": int(mon["prometheusRule"]["enabled"]),
        "PersistentVolumeClaim": int(hf_cache_created),
    }
    assert {kind: len(of_kind(objs, kind)) for kind in expected} == expected
    assert len(objs) == sum(expected.values()), sorted(o["kind"] for o in objs)


def test_notes_say_how_to_reach_the_api_and_the_dashboard() -> None:
    notes = render_files(load_values("cpu-small"))["raytp/templates/NOTES.txt"]
    assert "port-forward svc/raytp-serve-svc 8000:8000" in notes
    assert "port-forward svc/raytp-head-svc 8265:8265" in notes
    assert "Authorization: Bearer" in notes and "Grafana" in notes


def test_invalid_values_file_is_refused_naming_each_mistake() -> None:
    import yaml

    with pytest.raises(helm_python.HelmValuesError) as err:
        render(yaml.safe_load(INVALID_VALUES.read_text()))
    message = str(err.value)
    for expected in (
        "additional properties 'max_model_length' not allowed",
        "at '/engine/dtype': value must be one of",
        "additional properties 'numReplica' not allowed",
        "at '/worker/gpu/enabled': got string, want boolean",
        "at '/batch/backoffLimit': minimum: got 0, want 1",
        "at '/batch/data/claimName': minLength",
    ):
        assert expected in message, message


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"imagee": {"tag": "x"}}, "additional properties 'imagee' not allowed"),
        ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
        ({"model": {"source": "huggingface"}}, "/model/huggingface/id"),
        ({"model": {"source": "s3"}}, "/model/source"),
        ({"engine": {"tensor_parallel_size": 0}}, "/engine/tensor_parallel_size"),
        ({"engine": {"tensor_parallel_size": 2, "distributed_executor_backend": "inprocess"}}, "/engine"),
        ({"engine": {"block_size": 24}}, "/engine/block_size"),
        ({"engine": {"gpu_memory_utilization": 1.5}}, "/engine/gpu_memory_utilization"),
        (
            {"engine": {"speculative_config": {"method": "eagle", "num_speculative_tokens": 2}}},
            "/engine/speculative_config/method",
        ),
        ({"engine": {"speculative_config": {"method": "ngram"}}}, "/engine/speculative_config"),
        (
            {
                "models": [
                    {
                        "servedModelName": "x",
                        "engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}},
                    }
                ]
            },
            "/models/0/engine/speculative_config/num_speculative_tokens",
        ),
        ({"serving": {"autoscaling": {"config": {"min_replica": 1}}}}, "/serving/autoscaling/config"),
        ({"rayService": {"upgradeStrategy": {"type": "Rolling"}}}, "/rayService/upgradeStrategy/type"),
        (
            {"rayService": {"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade"}}},
            "/rayService/upgradeStrategy/clusterUpgradeOptions",
        ),
        ({"batch": {"enabled": True, "data": {"claimName": "d"}, "input": "/abs.jsonl"}}, "/batch/input"),
        ({"batch": {"shutdownAfterJobFinishes": False}}, "/batch/ttlSecondsAfterFinished"),
        ({"worker": {"resources": {"limits": {"cpu": "two"}}}}, "/worker/resources/limits/cpu"),
        ({"monitoring": {"podMonitors": {"interval": "fast"}}}, "/monitoring/podMonitors/interval"),
    ],
)
def test_schema_refuses(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(where)):
        render(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"engine": {"tensor_parallel_size": 2}, "worker": {"gpu": {"enabled": True, "perPod": 3}}},
            "worker.gpu.perPod (3) must be a multiple of engine.tensor_parallel_size (2)",
        ),
        (
            {"serving": {"autoscaling": {"enabled": True, "config": {"min_replicas": 3, "max_replicas": 2}}}},
            "min_replicas (3) exceeds max_replicas (2)",
        ),
        (
            {"serving": {"numReplicas": 3}, "worker": {"maxReplicas": 2}},
            "worker.maxReplicas (2) is below the 3 worker pods the model replicas need at start",
        ),
    ],
)
def test_templates_refuse_what_the_schema_cannot_express(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render(values)


def test_engine_values_are_exactly_the_engine_config_fields() -> None:
    """A field added to (or renamed in) EngineConfig must reach the chart's schema, and no stale one stays."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    chart_fields = set(schema["properties"]["engine"]["properties"])
    # `model` is not an engine value: the chart derives it from model.source.
    assert chart_fields == {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}


def test_attention_backend_choices_are_the_registrys() -> None:
    """The chart's schema cannot import ops/attention/registry.py, so it repeats the backend names: a backend
    added there (its file and its row) must be added to both engine schemas here too, or Helm refuses it."""
    from ops.attention.registry import ATTENTION_BACKENDS

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    engines = (schema["properties"]["engine"], schema["properties"]["models"]["items"]["properties"]["engine"])
    for engine in engines:
        assert engine["properties"]["attention_backend"]["enum"] == list(ATTENTION_BACKENDS)


def test_autoscaling_keys_are_serves() -> None:
    from ray.serve.config import AutoscalingConfig

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    keys = set(schema["properties"]["serving"]["properties"]["autoscaling"]["properties"]["config"]["properties"])
    assert keys <= set(AutoscalingConfig.model_fields), keys - set(AutoscalingConfig.model_fields)


def test_ray_version_agrees_across_chart_image_and_project() -> None:
    dockerfile = (ROOT / "k8s" / "Dockerfile").read_text()
    arg = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert arg is not None
    assert merged_values({})["rayVersion"] == arg.group(1) == ray.__version__


def test_image_copies_every_first_party_package() -> None:
    """The Dockerfile names what it copies; a new top-level package must not be left out of the image."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = {p.removesuffix("*") for p in patterns if (ROOT / p.removesuffix("*") / "__init__.py").exists()}
    modules = {f"{m}.py" for m in project["tool"]["setuptools"]["py-modules"]}
    copied = set(re.findall(r"^COPY \S+ (\S+) ", (ROOT / "k8s" / "Dockerfile").read_text(), re.M))
    assert tops | modules <= copied, (tops | modules) - copied


def _dockerfile_extras(variant: str, extras_arg: str = "") -> str:
    """The pip extras k8s/Dockerfile's install step picks for a build (its own shell lines, run by sh)."""
    text = (ROOT / "k8s" / "Dockerfile").read_text()
    lines = [ln.strip().removesuffix("\\").strip() for ln in text.splitlines() if "extras=" in ln and "$" in ln]
    assert lines, "the Dockerfile no longer computes its extras"
    script = "\n".join(lines) + '\nprintf %s "$extras"'
    env = {"VARIANT": variant, "EXTRAS": extras_arg, "PATH": "/usr/bin:/bin"}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout


def test_gpu_image_installs_the_gpu_road_and_gpu_values_select_it() -> None:
    """GPU builds install the `gpu` extra (Triton, the paged kernel `auto` runs on CUDA); CPU builds none;
    the chart's GPU values pick the GPU image."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("triton") for req in optional["gpu"])
    assert _dockerfile_extras("cpu") == ""
    assert _dockerfile_extras("gpu") == _dockerfile_extras("cu128") == "gpu"
    assert _dockerfile_extras("gpu", "gpu,cuda") == "gpu,cuda"
    assert set(_dockerfile_extras("gpu", "gpu,cuda").split(",")) <= set(optional)
    workers = of_kind(render(load_values("gpu-tp2")), "RayService")[0]["spec"]["rayClusterConfig"]
    images = {c["image"] for g in workers["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]}
    assert images == {"raytp:0.1.0-gpu"}


def test_names_fit_kuberay_limits() -> None:
    """KubeRay refuses RayService / RayJob names over 47 characters or not DNS-1035 labels."""
    values = {"batch": {"enabled": True, "data": {"claimName": "d"}}}
    for obj in render(values, release="a-very-long-release-name-that-goes-on-and-on-and-on"):
        if obj["kind"] in ("RayService", "RayJob"):
            name = obj["metadata"]["name"]
            assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
