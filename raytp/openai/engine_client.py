"""EngineClient: how a handler reaches one model replica's engine, and its transports side by side.

Every transport streams a request's `RequestDelta`s (text, stop strings, logprobs and finish reasons
already done by the engine's one output road) and aborts the request when the stream is closed early;
each also answers health and model info. Nothing here decodes or decides anything.

    in-process    `raytp.serve.replica.ModelReplica`: the engine loop in this process (the default
                  ingress replica hosts its own); an asyncio queue per request, no Ray message at all
    Serve handle  `ServeEngineClient`: the replicas of a `split_ingress` app's LLMServer deployment
                  (Serve balances across them); one Ray message per delta
    Ray actor     `ActorEngineClient`: an `EngineController` actor (a batch job's engine replica); one
                  Ray streaming call per request
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import ray
from ray.serve import context as serve_context
from ray.serve.handle import DeploymentResponseGenerator

from cluster.engine import EngineDeadError
from cluster.loop_records import ModelInfo
from cluster.outputs import RequestDelta
from request.lora import LoRARequest
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.serve.handle import DeploymentHandle


@dataclass(frozen=True)
class EngineRequest:
    """One engine request as a handler sends it through any transport (and as the Serve router reads it)."""

    request_id: str  # unique in the engine while it runs (ServingContext.stream adds a random suffix)
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # generation or pooling (the engine refuses the one it cannot run)
    lora_request: LoRARequest | None = None  # the adapter to run with; None: the base model


class EngineClient(Protocol):
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """The request's deltas, the last with finished=True; closing the iterator early aborts it.
        A request the engine refuses raises (RequestError; LoRAError for an adapter it cannot load) before
        the first delta."""
        ...

    async def health(self) -> None:
        """Raises when the engine cannot serve (the ingress answers 503)."""
        ...

    async def model_info(self) -> ModelInfo:
        """The engine's `EngineLoop.model_info`: max_model_len, vocab_size, ..."""
        ...


class ServeEngineClient:
    """The model replicas of an `LLMServer` deployment, through its handle."""

    def __init__(self, server: DeploymentHandle) -> None:
        self._handle = server
        self._server = server.options(stream=True)  # made once: options() builds a new handle

    async def health(self) -> None:
        await self._handle.health.remote()

    async def model_info(self) -> ModelInfo:
        info: ModelInfo = await self._handle.model_info.remote()
        return info

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        with _own_routing_id():
            stream = self._server.generate.remote(request)
        assert isinstance(stream, DeploymentResponseGenerator)  # a handle with stream=True
        finished = False
        try:
            async for delta in stream:
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                # The server replica turns the cancelled stream into an abort at its controller.
                stream.cancel()


@contextmanager
def _own_routing_id() -> Iterator[None]:
    """A fresh Serve internal request id for the handle calls made inside.

    Why: Ray Serve 2.60's request router indexes the requests it is placing by the internal id, which a
    handle call takes from the HTTP request being served; the several engine requests of one HTTP request
    (a list of prompts, embedding inputs, rerank documents) then share one, all but one are never matched
    to their replica, and the router spins on them forever (seen: a two-input /v1/embeddings hung a
    multi-model app and starved the ingress's health checks). The public request id (logs, X-Request-Id)
    is left as it is."""
    current = serve_context._get_serve_request_context()
    fresh = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    token = serve_context._serve_request_context.set(fresh)  # type: ignore[arg-type]  # Ray types it None
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


class ActorEngineClient:
    """One `EngineController` actor, through its streaming `generate`. A dead actor is an
    EngineDeadError (503 engine_unavailable), which a batch replica answers by starting a fresh one."""

    def __init__(self, controller: ActorHandle) -> None:
        self._controller = controller

    async def health(self) -> None:
        await self._controller.check_health.remote()

    async def model_info(self) -> ModelInfo:
        info: ModelInfo = await self._controller.model_info.remote()
        return info

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        finished = False
        try:
            # The actor is the engine loop itself (cluster/controller.py), whose generate takes the fields.
            stream: ray.ObjectRefGenerator = self._controller.generate.options(num_returns="streaming").remote(
                request.request_id, request.prompt_token_ids, request.params, lora_request=request.lora_request
            )
            async for ref in stream:
                delta: RequestDelta = await ref
                finished = delta.finished
                yield delta
        except ray.exceptions.RayActorError as e:
            finished = True
            raise EngineDeadError(f"the engine controller died: {e}") from None
        finally:
            if not finished:
                self._controller.abort.remote(request.request_id)
