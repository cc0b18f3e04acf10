"""`OpenAIIngress`: the FastAPI routes of the OpenAI-compatible API, as a Serve ingress deployment.

The ingress owns the tokenizer, the chat template, detokenization and stop strings; it
talks to the `LLMServer` deployment (the model replicas) through a DeploymentHandle.
Bodies are parsed here, after the API-key check, so a request without a valid key is a 401
whatever its body, and broken JSON is a 400 in OpenAI's error shape.

No `from __future__ import annotations` here: FastAPI must see the real `Request` class in
the route signatures (as strings, Serve's class-based routes would read it as a query field).
"""

import asyncio
import json
import logging
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.responses import Response

from cluster.serving.chat import ChatHandler
from cluster.serving.completions import CompletionHandler
from cluster.serving.context import ServingContext
from cluster.serving.errors import OpenAIError, bad_request, install_error_handlers, to_openai_error, validation_error
from cluster.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from model_exec.weights import load_tokenizer, resolve_model

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
API_KEY_ENV = "RAYTP_API_KEY"
_HEALTH_TIMEOUT_S = 10.0  # a replica being replaced must not hang the probe

app = FastAPI(title="raytp", description="OpenAI-compatible LLM serving on Ray")
install_error_handlers(app)


@dataclass(frozen=True)
class IngressSettings:
    model: str | None  # as in EngineConfig: the ingress loads the same tokenizer as the engine
    revision: str | None = None
    trust_remote_code: bool = False
    served_model_name: str | None = None  # None: the model's own name
    api_key: str | None = None  # None: RAYTP_API_KEY in the replica's environment, if set
    max_num_seqs: int = 256  # the engine's, for refusing requests with more samples than a step holds


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


async def _awaitable(response: Any) -> Any:
    return await response


@serve.ingress(app)
class OpenAIIngress:
    async def __init__(self, server: "DeploymentHandle", settings: IngressSettings) -> None:  # type: ignore[misc]
        source = resolve_model(settings.model, settings.revision)
        tokenizer = load_tokenizer(source, settings.trust_remote_code)
        info = await server.model_info.remote()  # waits for a model replica: ready means servable
        self.ctx = ServingContext(
            server=server,
            tokenizer=tokenizer,
            model_name=settings.served_model_name or source.name,
            max_model_len=int(info["max_model_len"]),
            vocab_size=int(info["vocab_size"]),
            max_num_seqs=settings.max_num_seqs,
        )
        self._api_key = settings.api_key or os.environ.get(API_KEY_ENV) or None
        self._completions = CompletionHandler(self.ctx)
        self._chat = ChatHandler(self.ctx)

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self._api_key):
            raise OpenAIError(
                "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                401,
                "invalid_request_error",
                code="invalid_api_key",
            )

    @app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(_awaitable(self.ctx.server.health.remote()), _HEALTH_TIMEOUT_S)
        except TimeoutError:
            return OpenAIError("the engine did not answer in time", 503, "server_error", code="engine_dead").response()
        except Exception as e:
            err = to_openai_error(e)
            if err.status < 500:  # whatever went wrong, the engine is not healthy
                err = OpenAIError(err.message, 503, "server_error", code="engine_dead")
            return err.response()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        card = ModelCard(id=self.ctx.model_name, root=self.ctx.model_name, max_model_len=self.ctx.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        return await self._completions.create(await parse_body(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        return await self._chat.create(await parse_body(request, ChatCompletionRequest))

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        req = await parse_body(request, TokenizeRequest)
        self.ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt or messages.", "prompt")
        if req.messages is not None:
            ids = self.ctx.chat_prompt_ids(req.messages, req.add_generation_prompt)
        else:
            assert req.prompt is not None
            ids = self.ctx.encode(req.prompt, req.add_special_tokens)
        resp = TokenizeResponse(count=len(ids), max_model_len=self.ctx.max_model_len, tokens=ids)
        return JSONResponse(resp.model_dump())

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest)
        self.ctx.check_model(req.model)
        if any(not 0 <= t < self.ctx.vocab_size for t in req.tokens):
            raise bad_request(f"tokens must be in [0, {self.ctx.vocab_size}) (the vocabulary size).", "tokens")
        return JSONResponse(DetokenizeResponse(prompt=self.ctx.tokenizer.decode(req.tokens)).model_dump())
