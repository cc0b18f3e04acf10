"""The route table: every route that takes a request body, one row each.

The HTTP app registers its POST routes from these rows (raytp/openai/app.py), and a batch job
accepts exactly these urls and answers a line with the row's own model and handler
(raytp/batch/input.py, raytp/batch/replica.py), so a batch body gets the server's validation and
the server's response body. A new route is one handler class and one row here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ValidationError

from raytp.openai.chat import ChatHandler
from raytp.openai.completions import CompletionHandler
from raytp.openai.context import ServingContext
from raytp.openai.embeddings import EmbeddingHandler
from raytp.openai.errors import validation_error
from raytp.openai.models import ServedModels
from raytp.openai.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from raytp.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from raytp.openai.score import RerankHandler, ScoreHandler
from raytp.openai.tokenize import DetokenizeHandler, TokenizeHandler


class Handler(Protocol):
    """One route's logic over the models one ingress replica (or batch replica) serves: each request's
    `model` picks its ServingContext (`ServedModels.resolve`), over HTTP and in batch jobs alike."""

    def __init__(self, models: ServedModels | ServingContext) -> None: ...

    async def create(self, req: Any, request_id: str) -> BaseModel | AsyncIterator[str]:
        """The response model, or (a streaming request) its SSE events. Raises what a client caused
        (RequestError, OpenAIError), which both the HTTP app and batch jobs map to the same error body."""
        ...


@dataclass(frozen=True)
class Route:
    method: Literal["POST"]  # a batch line names it too; routes without a body (GET) are the app's own
    path: str
    request: type[BaseModel]  # the body's model: FastAPI validates with it, and so does a batch line
    handler: type[Handler]  # made once per front door (`handlers`)
    id_prefix: str  # the response's `id` is `{id_prefix}-{request id}`, as OpenAI's `cmpl-...`

    def parse(self, body: dict[str, Any]) -> BaseModel:
        """A batch line's body as the HTTP route would parse it; a bad one raises the same 400."""
        try:
            return self.request.model_validate(body)
        except ValidationError as e:
            raise validation_error(e.errors()) from None


ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/completions", CompletionRequest, CompletionHandler, "cmpl"),
    Route("POST", "/v1/chat/completions", ChatCompletionRequest, ChatHandler, "chatcmpl"),
    Route("POST", "/v1/embeddings", EmbeddingRequest, EmbeddingHandler, "embd"),
    Route("POST", "/v1/score", ScoreRequest, ScoreHandler, "score"),
    Route("POST", "/v1/rerank", RerankRequest, RerankHandler, "rerank"),
    Route("POST", "/tokenize", TokenizeRequest, TokenizeHandler, "tokenize"),
    Route("POST", "/detokenize", DetokenizeRequest, DetokenizeHandler, "detokenize"),
)
ROUTES_BY_PATH: dict[str, Route] = {r.path: r for r in ROUTES}


def handlers(models: ServedModels | ServingContext) -> dict[str, Handler]:
    """Each route's handler over `models` (one ServingContext: that model alone), by path."""
    return {r.path: r.handler(models) for r in ROUTES}
