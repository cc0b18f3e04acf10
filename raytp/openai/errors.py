"""OpenAI-shaped errors and the HTTP status every failure maps to, by type.

    RequestError (a field the client got wrong)       400, with `param` and `code` from the error
    OpenAIError raised by the HTTP layer itself       its own status (401, 404, 413, 415, ...)
    EngineDeadError, a dead Ray actor                  503 engine_unavailable
    EngineOverloadedError                              503 engine_overloaded
    a request the engine could not finish              503 (RequestDelta.error)
    anything else                                      500 internal_error

Clients get a stable, safe message: a 5xx never carries exception types, process ids or node
addresses; the detail goes to the server log with the request id. No message is ever parsed.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from cluster.engine import EngineDeadError
from request.errors import RequestError

logger = logging.getLogger(__name__)

ENGINE_UNAVAILABLE = "The model engine is not available; retry later."
REQUEST_FAILED = "The server could not finish this request; retry later."
INTERNAL_ERROR = "The server had an internal error while processing the request."


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

    def body(self) -> dict[str, dict[str, str | int | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "invalid_request_error", param, code)


def unwrap(e: BaseException) -> BaseException:
    """The user-level exception inside Ray's wrappers (a Serve call may nest them)."""
    from ray.exceptions import RayTaskError

    while isinstance(e, RayTaskError) and e.cause is not None and e.cause is not e:
        e = e.cause
    return e


def to_openai_error(e: BaseException, request_id: str | None = None) -> OpenAIError:
    """Map any exception from parsing, the server deployment or the controller to a status, by type."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    e = unwrap(e)
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, RequestError):
        return OpenAIError(e.message, 400, e.error_type, e.param, e.code)
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(str(e), 503, "server_error", code="engine_overloaded")
    if isinstance(e, EngineDeadError | RayActorError | ActorDiedError | ActorUnavailableError):
        logger.warning("request %s: engine unavailable: %s", request_id, e)
        return OpenAIError(ENGINE_UNAVAILABLE, 503, "server_error", code="engine_unavailable")
    logger.error("request %s: internal error", request_id, exc_info=e)
    return OpenAIError(INTERNAL_ERROR, 500, "server_error", code="internal_error")


def request_failed(detail: str, request_id: str) -> OpenAIError:
    """A request the engine admitted but could not finish (a worker died, the replica shut down)."""
    logger.warning("request %s failed in the engine: %s", request_id, detail)
    return OpenAIError(REQUEST_FAILED, 503, "server_error", code="engine_unavailable")


def validation_error(errors: object) -> OpenAIError:
    """A 400 from pydantic's error list: the first error names the field (`param`)."""
    items = list(errors) if isinstance(errors, list | tuple) else []
    if not items:
        return bad_request("invalid request")
    # A cap (too many prompts) hides behind the type error of the union's first member (`prompt.str`):
    # the cap is what the client needs to hear.
    first = next((x for x in items if x.get("type") == "too_long"), items[0])
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request("The request body is not valid JSON.")
    # loc may go on into a union member ("prompt.str"): the top-level field is the param.
    return bad_request(f"{'.'.join(loc) or 'request'}: {first.get('msg')}", loc[0] if loc else None)
