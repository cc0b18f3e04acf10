"""The RayService's serveConfigV2 is a Serve config Ray accepts, its import_path imports, and
serve_app:build_app accepts its args and builds the Serve graph without loading a model (built in a
fresh process by tests/k8s/serve_build.py, the way Serve's controller builds a config)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

import pytest
from ray._common.utils import import_attr
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from tests.k8s.chart import (
    CI_VALUES,
    ROOT,
    container_env,
    load_values,
    merged_values,
    of_kind,
    one,
    pod_templates,
    render,
    serve_config,
)

SERVE_SETUPS = [s for s in ["default", *CI_VALUES] if merged_values(load_values(s))["rayService"]["enabled"]]


def _build(config: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.k8s.serve_build"],
        input=json.dumps(config),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    built: dict[str, Any] = json.loads(proc.stdout)
    return built


@functools.cache
def _built_setup(setup: str) -> dict[str, Any]:
    return _build(serve_config(render(load_values(setup))))


def _server(built: dict[str, Any]) -> dict[str, Any]:
    (server,) = [d for d in built["deployments"].values() if d["binds_engine"]]
    return server


def test_every_setup_with_a_service_is_checked() -> None:
    assert {"default", "cpu-small", "gpu-tp2"} <= set(SERVE_SETUPS)


@pytest.mark.parametrize("setup", SERVE_SETUPS)
def test_serve_config_is_valid_for_ray_serve(setup: str) -> None:
    config = serve_config(render(load_values(setup)))
    parsed = ServeDeploySchema.model_validate(config)
    assert [a.import_path for a in parsed.applications] == ["serve_app:build_app"]
    assert callable(import_attr(parsed.applications[0].import_path))
    # Serve ignores unknown application keys; a misspelt one would silently do nothing, so refuse it here.
    assert set(config) <= set(ServeDeploySchema.model_fields)
    for app in config["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields), set(app) - set(ServeApplicationSchema.model_fields)


@pytest.mark.parametrize("setup", SERVE_SETUPS)
def test_build_app_accepts_the_args_without_loading_a_model(setup: str) -> None:
    values = merged_values(load_values(setup))
    built = _built_setup(setup)  # build_app refuses unknown args, so every rendered arg was understood
    assert built["ray_initialized"] is False and built["model_code_imported"] == []

    (engine,) = built["engine_configs"]
    for name, value in values["engine"].items():
        assert engine[name] == value and type(engine[name]) is type(value), name
    source = values["model"]["source"]
    if source == "pvc":  # a path that exists only inside the pods: building did not open the model
        assert engine["model"] == f"{values['model']['pvc']['mountPath']}/{values['model']['pvc']['path']}"
    else:
        assert engine["model"] == {"embedded": None, "huggingface": values["model"]["huggingface"]["id"]}[source]

    server = _server(built)
    if values["serving"]["autoscaling"]["enabled"]:
        cfg = values["serving"]["autoscaling"]["config"]
        assert server["autoscaling"] == [cfg["min_replicas"], cfg["max_replicas"]]
    else:
        assert server["num_replicas"] == values["serving"]["numReplicas"]


def test_autoscaling_reaches_serve_and_the_kuberay_autoscaler() -> None:
    values = {"serving": {"autoscaling": {"enabled": True, "config": {"min_replicas": 1, "max_replicas": 3}}}}
    objs = render(values)
    assert _server(_build(serve_config(objs)))["autoscaling"] == [1, 3]
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    group = cluster["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 3)


def test_api_key_comes_from_a_secret_never_the_serve_config() -> None:
    values = {"serving": {"apiKey": {"secretName": "raytp-api-key", "secretKey": "key"}}}
    objs = render(values)
    service = one(objs, "RayService")
    assert "api_key" not in serve_config(objs)["applications"][0]["args"]
    for _, template in pod_templates(service):
        assert container_env(template)["RAYTP_API_KEY"] == {"secretKeyRef": {"name": "raytp-api-key", "key": "key"}}
    assert not of_kind(objs, "Secret")  # the chart refers to the Secret; it never holds the key


def test_split_ingress_reaches_build_app_with_its_ingress_replicas() -> None:
    """By default the model replicas serve HTTP (one deployment, no ingress_replicas arg); splitIngress
    puts LLMServer replicas behind the ingress."""
    default = serve_config(render({"serving": {"numReplicas": 3}}))
    assert "ingress_replicas" not in default["applications"][0]["args"]
    assert {name: (d["num_replicas"], d["binds_engine"]) for name, d in _build(default)["deployments"].items()} == {
        "OpenAIIngress": (3, True)
    }
    config = serve_config(render({"serving": {"splitIngress": True, "ingressReplicas": 2, "numReplicas": 3}}))
    args = config["applications"][0]["args"]
    assert (args["split_ingress"], args["ingress_replicas"]) == (True, 2)
    deployments = _build(config)["deployments"]
    assert deployments["OpenAIIngress"]["num_replicas"] == 2 and not deployments["OpenAIIngress"]["binds_engine"]
    assert deployments["LLMServer"]["num_replicas"] == 3 and deployments["LLMServer"]["binds_engine"]
