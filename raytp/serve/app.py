"""build_app: the Serve application graph from `ServeArgs`.

    one model (default)     OpenAIIngress replicas, each hosting one model replica (num_replicas or autoscaled)
    one model, split        `ingress_replicas` OpenAIIngress -> the LLMServer deployment (num_replicas or autoscaled)
    several models          `ingress_replicas` OpenAIIngress -> one LLMServer deployment per model, named
                            `LLMServer:<served name>`, each with its own replicas, TP size and engine settings
    + runtime LoRA updating a LoRARegistry deployment (one replica) that the ingresses and model replicas follow

`engine_deployment` is the one place a model replicas' deployment options are made (replicas, autoscaling,
admission, health checks; a request router goes there too).
"""

from __future__ import annotations

import re
from typing import Any

import ray
from ray import serve

from cluster.config import EngineConfig
from cluster.placement import cpus_per_worker
from raytp.openai.models import Adapter
from raytp.serve.args import ModelArgs, ServeArgs
from raytp.serve.ingress import OpenAIIngress
from raytp.serve.lora_registry import LoRARegistry
from raytp.serve.replica import LLMServer, served_executor_backend
from raytp.serve.routing import request_router_config

# every ingress and model replica holds a watch call open on the registry (lora_sync.py)
_REGISTRY_MAX_ONGOING = 100_000


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application; `import_path: serve_app:build_app` in a Serve config YAML.

    args = {"model": None, "tensor_parallel_size": 1, ...any EngineConfig field..., "num_replicas": 1 |
            "autoscaling_config": {...}, "lora_modules": [...], "api_key": ..., "split_ingress": False, ...}
        or {"models": [{"model": ..., "served_model_name": ..., "num_replicas": ..., ...}, ...],
            ...application keys, and model keys every model takes unless its entry sets them...}
    """
    sa = ServeArgs.from_dict(dict(args or {})).api_key_from_env().runtime_lora_from_env()
    registry = None
    if sa.enable_runtime_lora_updating:
        adapters = [Adapter(lora, base) for base, lora in sa.lora_requests()]
        registry = serve.deployment(
            name="LoRARegistry",
            num_replicas=1,
            max_ongoing_requests=_REGISTRY_MAX_ONGOING,
            ray_actor_options={"num_cpus": 0},
        )(LoRARegistry).bind([m.name for m in sa.models], adapters)
    if not sa.split:
        ingress = serve.deployment(name="OpenAIIngress", **engine_deployment(sa, sa.model))(OpenAIIngress)
        return ingress.bind(sa, None, registry)
    startup = sa.lora_requests()
    servers = {
        m.name: serve.deployment(name=server_name(sa, m), **engine_deployment(sa, m))(LLMServer).bind(
            m, [lora for base, lora in startup if base == m.name], registry
        )
        for m in sa.models
    }
    ingress = serve.deployment(
        name="OpenAIIngress",
        num_replicas=sa.ingress_replicas or 1,
        # one ingress replica may carry every model's requests at once
        max_ongoing_requests=sum(m.max_ongoing_requests for m in sa.models),
        ray_actor_options={"num_cpus": 0},
    )(OpenAIIngress)
    return ingress.bind(sa, servers, registry)


def engine_deployment(sa: ServeArgs, model: ModelArgs) -> dict[str, Any]:
    """The deployment options of `model`'s replicas (the ingress itself, or its LLMServer deployment when
    split), from the model's args and the application's."""
    options: dict[str, Any] = {
        "max_ongoing_requests": model.max_ongoing_requests,
        "health_check_period_s": model.health_check_period_s,
        "ray_actor_options": model_replica_resources(model.engine),
    }
    if model.autoscaling_config is not None:
        options["autoscaling_config"] = model.autoscaling_config
    else:
        options["num_replicas"] = model.num_replicas if model.num_replicas is not None else 1
    if sa.split:  # the ingress reaches these replicas through a handle: Serve's router picks one per request
        options["request_router_config"] = request_router_config(sa.request_router or "prefix", model.engine.block_size)
    return options


def model_replica_resources(engine: EngineConfig) -> dict[str, float]:
    """What a model replica reserves. With its model in TP worker actors, nothing: the workers' placement group
    holds the compute. With its model in its own process (the in-process executor), what that one rank's bundle
    would hold: RAYTP_CPUS_PER_WORKER CPUs, and one GPU where the model runs on CUDA (`device="auto"`: where the
    cluster has GPUs, as for Ray ranks), so Ray places the replica where its model can run."""
    if served_executor_backend(engine) != "inprocess":
        return {"num_cpus": 0}
    # Off a cluster (an app built only to check its args) no GPU can be seen, and none is reserved.
    cluster_gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    gpu = engine.device == "cuda" or (engine.device == "auto" and cluster_gpus >= 1)
    return {"num_cpus": cpus_per_worker(), **({"num_gpus": 1} if gpu else {})}


def server_name(sa: ServeArgs, model: ModelArgs) -> str:
    """The model replicas' deployment: `LLMServer` for the one model of a split app (as always), else
    `LLMServer:<served name>` (Serve refuses '#' in a deployment name)."""
    if len(sa.models) == 1:
        return "LLMServer"
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9._/:-]", "_", model.name)
