"""build_app: the Serve application graph from `ServeArgs`. By default, `num_replicas` (or autoscaled)
OpenAIIngress replicas, each hosting one model replica; with `split_ingress`, `ingress_replicas`
OpenAIIngress replicas in front of `num_replicas` (or autoscaled) LLMServer replicas.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from raytp.serve.args import ServeArgs
from raytp.serve.ingress import OpenAIIngress
from raytp.serve.replica import LLMServer
from raytp.serve.routing import request_router_config


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application; `import_path: serve_app:build_app` in a Serve config YAML.

    args = {"model": None, "tensor_parallel_size": 1, ...any EngineConfig field...,
            "num_replicas": 1 | "autoscaling_config": {...}, "api_key": ..., "max_waiting_requests": ...,
            "split_ingress": False, "ingress_replicas": None (with split_ingress)}
    """
    sa = ServeArgs.from_dict(dict(args or {})).api_key_from_env()
    # The model replicas' deployment: the ingress itself, or LLMServer with split_ingress. No CPUs are
    # reserved for it: the compute is reserved by the TP worker actors.
    replicas: dict[str, Any] = {"max_ongoing_requests": sa.max_ongoing_requests, "ray_actor_options": {"num_cpus": 0}}
    if sa.autoscaling_config is not None:
        replicas["autoscaling_config"] = sa.autoscaling_config
    else:
        replicas["num_replicas"] = sa.num_replicas if sa.num_replicas is not None else 1
    if sa.health_check_period_s is not None:
        replicas["health_check_period_s"] = sa.health_check_period_s
    if not sa.split_ingress:
        return serve.deployment(name="OpenAIIngress", **replicas)(OpenAIIngress).bind(sa)
    router = request_router_config(sa.request_router or "prefix", sa.engine.block_size)
    server = serve.deployment(name="LLMServer", request_router_config=router, **replicas)(LLMServer).bind(sa)
    ingress = serve.deployment(
        name="OpenAIIngress",
        num_replicas=sa.ingress_replicas or 1,
        max_ongoing_requests=sa.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )(OpenAIIngress)
    return ingress.bind(sa, server)
