"""The FastAPI application object of the OpenAI-compatible API: error handlers and the request guard.

The routes themselves are methods of the `OpenAIIngress` Serve deployment in `serve_app.py`
(Serve's class-based ingress); they declare their pydantic request models as bodies, so
`/openapi.json` states the real contract. Everything else a request meets first lives here:

- `RequestGuard` (pure ASGI, so it runs before any body is read): the API key on every `/v1/*`
  path, known route or not (401 before 404 or 400, as vLLM guards `/v1`).
- exception handlers: every failure becomes OpenAI's error shape (`errors.py` decides the status).
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from raytp.openai.errors import OpenAIError, to_openai_error, validation_error

API_KEY_ENV = "RAYTP_API_KEY"


class RequestGuard:
    """ASGI middleware: refuses a request before its body is read. The key lives in `app.state.api_key`
    (set by the ingress replica at start-up; None: no key required)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _check(scope: Scope) -> OpenAIError | None:
        api_key: str | None = getattr(scope["app"].state, "api_key", None)
        path: str = scope.get("path", "")
        if api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
                return OpenAIError(
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                    401,
                    "invalid_request_error",
                    code="invalid_api_key",
                )
        return None


def build_api() -> FastAPI:
    app = FastAPI(title="raytp", description="OpenAI-compatible LLM serving on Ray")
    app.state.api_key = None
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
        return to_openai_error(e, request.headers.get("x-request-id")).response()

    from ray.exceptions import RayError

    for cls in (ValueError, RuntimeError, RayError, Exception):
        app.add_exception_handler(cls, _mapped)


def json_response(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump())
