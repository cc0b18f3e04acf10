"""The FastAPI app of one ingress replica: the request guard, error handlers, and the routes.

Built per ingress replica (`build_api` / `openai_app`) from the settings it is given, so nothing is
written into it afterwards and two applications in one Serve cluster never share one. Everything a
request meets first lives here:

- `RequestGuard` (`guard.py`, pure ASGI, so it runs before any body is read): the API key on every
  `/v1/*` path, known route or not (401 before anything else, as vLLM guards `/v1`), then
  `Content-Type: application/json` (415) and the body size limit (413).
- exception handlers: every failure becomes OpenAI's error shape (`errors.py` decides the status).
- routes: the POST routes come from the route table (routes.py), each declaring its pydantic request
  model as its body, so `/openapi.json` states the real contract; the GET routes and the runtime LoRA
  routes (lora_routes.py) are the app's own. A request's `model` picks what answers it (`ServedModels`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from cluster.metrics.endpoint import CONTENT_TYPE, application_metrics
from raytp.openai.context import SSE_HEADERS
from raytp.openai.errors import OpenAIError, to_openai_error, validation_error
from raytp.openai.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard
from raytp.openai.lora_routes import LoRAAdmin, add_lora_routes
from raytp.openai.models import ServedModels
from raytp.openai.protocol import ModelList
from raytp.openai.request_id import request_id_of
from raytp.openai.routes import ROUTES, Handler, Route, handlers

HEALTH_TIMEOUT_S = 10.0  # a replica being replaced must not hang the probe


def build_api(api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An app with the guard and the error handlers, and no routes yet."""
    app = FastAPI(title="raytp", description="OpenAI-compatible LLM serving on Ray")
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes)
    install_error_handlers(app)
    return app


def openai_app(
    models: ServedModels,
    health: Callable[[], Awaitable[None]],
    api_key: str | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lora_admin: LoRAAdmin | None = None,
) -> FastAPI:
    """The whole API of one ingress replica over `models`; `health` raises when an engine cannot serve;
    `lora_admin`: None unless runtime LoRA updating is on."""
    app = build_api(api_key, max_body_bytes)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text: the raytp and Ray Serve series of every node, as Ray's metrics agents export
        them (a pass-through, no second aggregation: cluster/metrics/endpoint.py). Not behind the API key,
        like `vllm serve`'s /metrics. Scrape this or the nodes' metrics ports, not both."""
        return Response(await application_metrics(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health_route() -> Response:
        try:
            await asyncio.wait_for(health(), HEALTH_TIMEOUT_S)
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

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return json_response(ModelList(data=models.cards()))

    @app.get("/v1/models/{name:path}")  # :path: hub ids have a slash (org/name)
    async def model_card(name: str) -> JSONResponse:
        return json_response(models.card(name))

    add_lora_routes(app, models, lora_admin)
    bound = handlers(models)
    for route in ROUTES:
        endpoint = _endpoint(route, bound[route.path])
        app.add_api_route(route.path, endpoint, methods=[route.method], name=route.handler.__name__)
    return app


def _endpoint(route: Route, handler: Handler) -> Callable[[BaseModel, Request], Awaitable[Response]]:
    async def endpoint(body: BaseModel, raw: Request) -> Response:
        # The body's `id`: the row's prefix and the request's `X-Request-Id` (raytp/openai/request_id.py).
        return respond(await handler.create(body, f"{route.id_prefix}-{request_id_of(raw.headers.raw)}"))

    # FastAPI validates the body against the annotated model (and /openapi.json states it): the row's own.
    endpoint.__annotations__["body"] = route.request
    return endpoint


def respond(result: Any) -> Response:
    """A handler's result as HTTP: an SSE stream, or the response model as JSON."""
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return json_response(result)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = "Not found." if e.status_code == 404 else str(e.detail)
        return OpenAIError(message, e.status_code, kind).response()

    # Expected failures get handlers of their own: Starlette logs a traceback for, and re-raises,
    # whatever only the catch-all `Exception` handler takes.
    async def _mapped(request: Request, e: Exception) -> JSONResponse:
        return to_openai_error(e, request_id_of(request.headers.raw)).response()

    from ray.exceptions import RayError

    for cls in (ValueError, RuntimeError, RayError, Exception):
        app.add_exception_handler(cls, _mapped)


def json_response(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump())
