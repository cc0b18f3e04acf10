"""`build_app(args)`: the Serve application from plain arguments (CLI, `serve run`, config YAML).

    args = {"model": None, "tensor_parallel_size": 1, ...any EngineConfig field...,
            "num_replicas": 1 | "autoscaling_config": {...}, "api_key": ..., "max_waiting_requests": ...}

Unknown keys are refused (a typo must not silently fall back to a default). The graph is
ingress -> LLMServer; the ingress scales with `ingress_replicas`, the model with
`num_replicas` or `autoscaling_config` (Serve's own schema, passed through untouched).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from cluster.config import EngineConfig
from cluster.serving.ingress import API_KEY_ENV, IngressSettings, OpenAIIngress
from cluster.serving.server import DEFAULT_MAX_ONGOING_REQUESTS, server_deployment

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


@dataclass(frozen=True)
class ServeArgs:
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None
    num_replicas: int | None = None  # None with no autoscaling_config: 1
    autoscaling_config: dict[str, Any] | None = None  # Serve's AutoscalingConfig, for the model replicas
    ingress_replicas: int = 1
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS  # per replica, both deployments
    max_waiting_requests: int | None = None  # 503 once a replica's waiting queue holds this many
    api_key: str | None = None
    health_check_period_s: float | None = None  # None: Serve's default

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("num_replicas and autoscaling_config are exclusive: give one of them.")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}.")
        if self.ingress_replicas < 1:
            raise ValueError(f"ingress_replicas must be at least 1, got {self.ingress_replicas}.")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be at least 1, got {self.max_ongoing_requests}.")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be non-negative, got {self.max_waiting_requests}.")

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ServeArgs:
        own = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        unknown = set(args) - own - _ENGINE_FIELDS
        if unknown:
            raise ValueError(f"unknown serve arguments: {', '.join(sorted(unknown))}")
        engine = EngineConfig(**{k: v for k, v in args.items() if k in _ENGINE_FIELDS})
        return cls(engine=engine, **{k: v for k, v in args.items() if k in own})


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application; `import_path: serve_app:build_app` in a Serve config YAML."""
    sa = ServeArgs.from_dict(dict(args or {}))
    engine = sa.engine
    server = server_deployment(
        sa.num_replicas, sa.autoscaling_config, sa.max_ongoing_requests, sa.health_check_period_s
    ).bind(engine, sa.max_waiting_requests)
    settings = IngressSettings(
        model=engine.model,
        revision=engine.revision,
        trust_remote_code=engine.trust_remote_code,
        served_model_name=sa.served_model_name,
        max_num_seqs=engine.max_num_seqs,
        # Read here too, so `RAYTP_API_KEY=... raytp serve` protects a cluster started earlier.
        api_key=sa.api_key or os.environ.get(API_KEY_ENV) or None,
    )
    ingress = serve.deployment(
        name="OpenAIIngress",
        num_replicas=sa.ingress_replicas,
        max_ongoing_requests=sa.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )(OpenAIIngress)
    return ingress.bind(server, settings)
