"""The FastAPI application object of the OpenAI-compatible API: error handlers and the request guard.

The routes themselves are methods of the `OpenAIIngress` Serve deployment in `serve_app.py`
(Serve's class-based ingress); they declare their pydantic request models as bodies, so
`/openapi.json` states the real contract. Everything else a request meets first lives here:

- `RequestGuard` (`guard.py`, pure ASGI, so it runs before any body is read): the API key on every
  `/v1/*` path, known route or not (401 before anything else, as vLLM guards `/v1`), then
  `Content-Type: application/json` (415) and the body size limit (413).
- exception handlers: every failure becomes OpenAI's error shape (`errors.py` decides the status).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from raytp.openai.errors import OpenAIError, to_openai_error, validation_error
from raytp.openai.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard
from raytp.openai.request_id import request_id_of

API_KEY_ENV = "RAYTP_API_KEY"


def build_api() -> FastAPI:
    app = FastAPI(title="raytp", description="OpenAI-compatible LLM serving on Ray")
    app.state.api_key = None
    app.state.max_body_bytes = DEFAULT_MAX_BODY_BYTES
    app.add_middleware(RequestGuard)
    install_error_handlers(app)
    return app


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
