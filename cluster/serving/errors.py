"""OpenAI-shaped errors and the HTTP status every failure maps to.

Statuses (issue 4): 400 bad fields / broken JSON / too long prompt, 401 bad or missing API key,
404 unknown model or route, 503 engine dead or waiting queue over its bound, 500 anything else.
Every exception a handler can raise ends here, so no input crashes a replica.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.engine import EngineDeadError

logger = logging.getLogger(__name__)

_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ")


class EngineOverloadedError(RuntimeError):
    """The replica's waiting queue is over `max_waiting_requests`: retry later (503)."""


class OpenAIError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "invalid_request_error", param)


def unwrap(e: BaseException) -> BaseException:
    """The user-level exception inside Ray's wrappers (a Serve call may nest them)."""
    from ray.exceptions import RayTaskError

    while isinstance(e, RayTaskError) and e.cause is not None and e.cause is not e:
        e = e.cause
    return e


def to_openai_error(e: BaseException) -> OpenAIError:
    """Map any exception from parsing, the server deployment or the controller to a status."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    e = unwrap(e)
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        # SamplingParams / engine validation: messages start with the offending field's name.
        m = _FIELD.match(str(e))
        return bad_request(str(e), m.group(1) if m else None)
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(str(e), 503, "server_error", code="engine_overloaded")
    if isinstance(e, EngineDeadError | RayActorError | ActorDiedError | ActorUnavailableError):
        return OpenAIError(f"the engine is not available: {e}", 503, "server_error", code="engine_dead")
    logger.exception("internal error", exc_info=e)
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", 500, "server_error")


def error_for_delta(message: str) -> OpenAIError:
    """A RequestDelta.error: a prompt the scheduler refused is 400; anything else (a failed or
    shut-down engine, a request evicted from the cache) is the server's problem, 503."""
    if message.startswith("the prompt"):
        return bad_request(message, "prompt")
    return OpenAIError(message, 503, "server_error", code="engine_unavailable")


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
        return OpenAIError(str(e.detail), e.status_code, kind).response()

    # Expected failures get handlers of their own: Starlette logs a traceback for, and re-raises,
    # whatever only the catch-all `Exception` handler takes.
    async def _mapped(_: Request, e: Exception) -> JSONResponse:
        return to_openai_error(e).response()

    from ray.exceptions import RayError

    for cls in (ValueError, RuntimeError, RayError, Exception):
        app.add_exception_handler(cls, _mapped)


def validation_error(errors: object) -> OpenAIError:
    """A 400 from pydantic's error list: the first error names the field (`param`)."""
    items = list(errors) if isinstance(errors, list | tuple) else []
    if not items:
        return bad_request("invalid request")
    first = items[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg')}")
    # loc may go on into a union member ("prompt.str"): the top-level field is the param.
    return bad_request(f"{'.'.join(loc) or 'request'}: {first.get('msg')}", loc[0] if loc else None)
