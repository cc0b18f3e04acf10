"""The RayService's serveConfigV2 is a Serve config Ray accepts, its import_path imports, and
serve_app:build_app accepts its args and builds the Serve graph without loading a model (built in a
fresh process by tests/k8s/serve_build.py, the way Serve's controller builds a config)."""

from __future__ import annotations

import functools
import json
import shlex
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
    if values["models"]:
        _check_models(values, built)
        return

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


def _check_models(values: dict[str, Any], built: dict[str, Any]) -> None:
    """Each entry of `models` is one LLMServer deployment with the engine values as defaults under its own."""
    servers = {d["served_names"][0]: d for d in built["deployments"].values() if d["binds_engine"]}
    assert list(servers) == [m["servedModelName"] for m in values["models"]]
    engines = dict(zip(servers, built["engine_configs"], strict=True))
    for m in values["models"]:
        engine = engines[m["servedModelName"]]
        for name, value in {**values["engine"], **m.get("engine", {})}.items():
            assert engine[name] == value and type(engine[name]) is type(value), (m["servedModelName"], name)
        source = m.get("source", "embedded")
        if source == "pvc":
            assert engine["model"] == f"{values['model']['pvc']['mountPath']}/{m['path']}"
        else:
            assert engine["model"] == {"embedded": None, "huggingface": m.get("id")}[source]
        server = servers[m["servedModelName"]]
        scaling = m.get("autoscaling") or values["serving"]["autoscaling"]
        if scaling["enabled"]:
            assert server["autoscaling"] == [scaling["config"]["min_replicas"], scaling["config"]["max_replicas"]]
        else:
            assert server["num_replicas"] == m.get("numReplicas", values["serving"]["numReplicas"])
    ingress = built["deployments"]["OpenAIIngress"]
    assert not ingress["binds_engine"] and ingress["num_replicas"] == values["serving"]["ingressReplicas"]


def test_two_models_from_the_chart_reach_build_app() -> None:
    """Two models in values: serveConfigV2's args.models lists both (each its source, replicas or autoscaling,
    engine values over the shared ones, LoRA modules); Serve accepts the config and build_app builds one
    LLMServer deployment per model behind one ingress, plus the LoRA registry; the worker pods add up."""
    values = {
        "model": {"pvc": {"claimName": "models", "mountPath": "/models"}},
        "engine": {"max_model_len": 2048},
        "models": [
            {
                "servedModelName": "qwen",
                "source": "pvc",
                "path": "qwen2.5",
                "numReplicas": 2,
                "engine": {"tensor_parallel_size": 2, "enable_lora": True, "max_lora_rank": 32},
                "loraModules": [{"name": "sql", "path": "/models/adapters/sql"}],
            },
            {
                "servedModelName": "llama",
                "source": "huggingface",
                "id": "meta-llama/Llama-3.2-1B-Instruct",
                "autoscaling": {"enabled": True, "config": {"min_replicas": 1, "max_replicas": 3}},
            },
        ],
        "serving": {"ingressReplicas": 2, "enableRuntimeLoraUpdating": True},
    }
    objs = render(values)
    config = serve_config(objs)
    ServeDeploySchema.model_validate(config)
    args = config["applications"][0]["args"]
    assert args["models"] == [
        {
            "served_model_name": "qwen",
            "model": "/models/qwen2.5",
            "num_replicas": 2,
            "tensor_parallel_size": 2,
            "enable_lora": True,
            "max_lora_rank": 32,
            "lora_modules": [{"name": "sql", "path": "/models/adapters/sql"}],
        },
        {
            "served_model_name": "llama",
            "model": "meta-llama/Llama-3.2-1B-Instruct",
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
        },
    ]
    assert args["max_model_len"] == 2048 and args["enable_runtime_lora_updating"] is True
    assert "num_replicas" not in args and "model" not in args  # per model only
    built = _build(config)
    assert built["ray_initialized"] is False and built["model_code_imported"] == []
    deployments = built["deployments"]
    assert set(deployments) == {"OpenAIIngress", "LLMServer:qwen", "LLMServer:llama", "LoRARegistry"}
    assert deployments["OpenAIIngress"]["num_replicas"] == 2 and not deployments["OpenAIIngress"]["binds_engine"]
    assert deployments["LLMServer:qwen"]["num_replicas"] == 2
    assert deployments["LLMServer:llama"]["autoscaling"] == [1, 3]
    qwen, llama = built["engine_configs"]
    assert (qwen["tensor_parallel_size"], qwen["enable_lora"], qwen["max_model_len"]) == (2, True, 2048)
    assert (llama["tensor_parallel_size"], llama["enable_lora"], llama["max_model_len"]) == (1, False, 2048)
    # Worker pods (CPU: one model replica each): 2 of qwen + llama's 1..3.
    group = one(objs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (3, 5)
    # Both model sources are mounted, on every pod.
    for _, template in pod_templates(one(objs, "RayService")):
        volumes = {v["name"] for v in template["spec"]["volumes"]}
        assert {"model", "hf-cache"} <= volumes
        assert "HF_HOME" in container_env(template)


def test_a_model_entry_is_checked_by_the_schema() -> None:
    with pytest.raises(Exception, match="servedModelName"):
        render({"models": [{"source": "embedded"}]})
    with pytest.raises(Exception, match="id"):
        render({"models": [{"servedModelName": "x", "source": "huggingface"}]})
    with pytest.raises(Exception, match="enable_lor"):
        render({"models": [{"servedModelName": "x", "engine": {"enable_lor": True}}]})


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
    """One model replica serves HTTP itself; 2+ run as LLMServer replicas behind one ingress (prefix routing)
    unless splitIngress is false; splitIngress: true sets the ingress replicas."""
    one = serve_config(render({"serving": {"numReplicas": 1}}))
    assert "ingress_replicas" not in one["applications"][0]["args"]
    assert {name: (d["num_replicas"], d["binds_engine"]) for name, d in _build(one)["deployments"].items()} == {
        "OpenAIIngress": (1, True)
    }
    three = _build(serve_config(render({"serving": {"numReplicas": 3}})))["deployments"]
    assert {name: (d["num_replicas"], d["binds_engine"]) for name, d in three.items()} == {
        "OpenAIIngress": (1, False),
        "LLMServer": (3, True),
    }
    pow2 = serve_config(render({"serving": {"numReplicas": 2, "requestRouter": "pow2"}}))
    assert pow2["applications"][0]["args"]["request_router"] == "pow2"
    _build(pow2)
    unsplit = serve_config(render({"serving": {"numReplicas": 3, "splitIngress": False}}))
    assert unsplit["applications"][0]["args"]["split_ingress"] is False
    assert {name: d["num_replicas"] for name, d in _build(unsplit)["deployments"].items()} == {"OpenAIIngress": 3}
    config = serve_config(render({"serving": {"splitIngress": True, "ingressReplicas": 2, "numReplicas": 3}}))
    args = config["applications"][0]["args"]
    assert (args["split_ingress"], args["ingress_replicas"]) == (True, 2)
    deployments = _build(config)["deployments"]
    assert deployments["OpenAIIngress"]["num_replicas"] == 2 and not deployments["OpenAIIngress"]["binds_engine"]
    assert deployments["LLMServer"]["num_replicas"] == 3 and deployments["LLMServer"]["binds_engine"]


def test_speculative_config_reaches_build_app_and_the_batch_entrypoint() -> None:
    """engine.speculative_config (and a model entry's own) is rendered into serveConfigV2's args, which
    build_app reads into each model's EngineConfig, and into the RayJob's `--speculative-config` JSON."""
    from raytp.cli.args import engine_config_from_args
    from raytp.cli.main import build_parser

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    values = {"engine": {"speculative_config": ngram}, "batch": {"enabled": True, "data": {"claimName": "d"}}}
    objs = render(values)
    config = serve_config(objs)
    assert config["applications"][0]["args"]["speculative_config"] == ngram
    (engine,) = _build(config)["engine_configs"]
    assert engine["speculative_config"] == ngram
    words = shlex.split(one(objs, "RayJob")["spec"]["entrypoint"])
    assert engine_config_from_args(build_parser().parse_args(words[1:])).speculative_config == ngram
    # A model entry's own value over the shared one; another entry keeps the shared one.
    own = {**ngram, "num_speculative_tokens": 2}
    two = {
        "engine": {"speculative_config": ngram},
        "models": [{"servedModelName": "a", "engine": {"speculative_config": own}}, {"servedModelName": "b"}],
    }
    engines = _build(serve_config(render(two)))["engine_configs"]
    assert [e["speculative_config"] for e in engines] == [own, ngram]
