"""The RayService's serveConfigV2 is a Serve config Ray accepts, its import_path imports, and
serve_app:build_app accepts its args and builds the Serve graph without loading a model.

The build goes through the same two calls Serve's controller makes for a config (import_attr, then
call_user_app_builder_with_args_if_necessary), then Serve's own flattening into deployments, so the
deployment settings checked below are the ones a cluster would run."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.build_app import build_app
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from cluster.config import EngineConfig
from tests.k8s.chart import CI_VALUES, container_env, load_values, merged_values, of_kind, one, pod_templates, render
from tests.k8s.chart import serve_config as rendered_serve_config

SERVE_SETUPS = [s for s in ["default", *CI_VALUES] if merged_values(load_values(s))["rayService"]["enabled"]]


@pytest.fixture(autouse=True)
def _no_ray_cluster() -> None:
    # The checks below rely on no Ray being started in this process: a model loads only inside the
    # engine controller actors a running cluster would create.
    assert not ray.is_initialized()


def _built(config: dict[str, Any]) -> dict[str, Any]:
    """Deployment name -> Serve Deployment, built the way Serve's controller builds the config."""
    app_config = config["applications"][0]
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_config["import_path"]), app_config["args"])
    built = build_app(app, name=app_config["name"], route_prefix=app_config["route_prefix"])
    return {d.name: d for d in built.deployments}


def _engine_config(deployments: dict[str, Any]) -> EngineConfig:
    found = [a for d in deployments.values() for a in d.init_args if isinstance(a, EngineConfig)]
    assert len(found) == 1, f"expected one deployment bound to an EngineConfig, found {len(found)}"
    return found[0]


def test_every_setup_with_a_service_is_checked() -> None:
    assert {"default", "cpu-small", "gpu-tp2"} <= set(SERVE_SETUPS)


@pytest.mark.parametrize("setup", SERVE_SETUPS)
def test_serve_config_is_valid_for_ray_serve(setup: str) -> None:
    config = rendered_serve_config(render(load_values(setup)))
    parsed = ServeDeploySchema.model_validate(config)
    assert [a.import_path for a in parsed.applications] == ["serve_app:build_app"]
    # Serve ignores unknown application keys; a misspelt one would silently do nothing, so refuse it here.
    assert set(config) <= set(ServeDeploySchema.model_fields)
    for app in config["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields), set(app) - set(ServeApplicationSchema.model_fields)


@pytest.mark.parametrize("setup", SERVE_SETUPS)
def test_build_app_accepts_the_args_without_loading_a_model(setup: str) -> None:
    values = merged_values(load_values(setup))
    config = rendered_serve_config(render(load_values(setup)))
    deployments = _built(config)  # build_app refuses unknown args, so every rendered arg is understood

    engine = _engine_config(deployments)
    assert engine.tensor_parallel_size == values["engine"]["tensor_parallel_size"]
    for name, value in values["engine"].items():
        assert getattr(engine, name) == value, name
    if values["model"]["source"] == "pvc":
        # A path that exists only inside the pods: building did not open the model.
        assert engine.model == f"{values['model']['pvc']['mountPath']}/{values['model']['pvc']['path']}"
    elif values["model"]["source"] == "embedded":
        assert engine.model is None

    server = next(d for d in deployments.values() if any(isinstance(a, EngineConfig) for a in d.init_args))
    if values["serving"]["autoscaling"]["enabled"]:
        assert server._deployment_config.autoscaling_config is not None
    else:
        assert server.num_replicas == values["serving"]["numReplicas"]
    assert not ray.is_initialized(), "building the app started Ray"


def test_autoscaling_reaches_serve_and_the_kuberay_autoscaler() -> None:
    values = {"serving": {"autoscaling": {"enabled": True, "config": {"min_replicas": 1, "max_replicas": 3}}}}
    objs = render(values)
    server = next(
        d for d in _built(rendered_serve_config(objs)).values() if any(isinstance(a, EngineConfig) for a in d.init_args)
    )
    autoscaling = server._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 3)
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    group = cluster["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 3)


def test_api_key_comes_from_a_secret_never_the_serve_config() -> None:
    values = {"serving": {"apiKey": {"secretName": "raytp-api-key", "secretKey": "key"}}}
    objs = render(values)
    service = one(objs, "RayService")
    assert "api_key" not in rendered_serve_config(objs)["applications"][0]["args"]
    for _, template in pod_templates(service):
        assert container_env(template)["RAYTP_API_KEY"] == {"secretKeyRef": {"name": "raytp-api-key", "key": "key"}}
    assert not of_kind(objs, "Secret")  # the chart refers to the Secret; it never holds the key
