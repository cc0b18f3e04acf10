"""`RequestGuard`: what a request must pass before any route sees it, in this order.

    1. the API key, on every `/v1/*` path, known route or not      401 (before 404, 415, 413 or 400,
                                                                       so routes cannot be probed)
    2. a body-carrying method must send `Content-Type: application/json`   415
    3. the body must fit `max_body_bytes`                            413

Pure ASGI (not Starlette's BaseHTTPMiddleware), so it answers before the body is read: a refused
request costs no parsing. (2) matters on servers without a key: a browser sends `text/plain`
cross-origin without a CORS preflight, so any web page could otherwise drive the API. (3) bounds the
JSON parse and validation that run on the ingress event loop; the body is read here, up to the limit,
and replayed to the route.

Its settings (`api_key`, `max_body_bytes`) are given when the app is built (`build_api`), one app per
ingress replica: nothing is written into the app afterwards.
"""

from __future__ import annotations

import email.message
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raytp.openai.errors import OpenAIError

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: ~1M tokens of text; far above any max_model_len we serve
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers") or []}


def _is_json(content_type: bytes | None) -> bool:
    if not content_type:
        return False
    msg = email.message.Message()
    msg["content-type"] = content_type.decode("latin-1")
    return msg.get_content_type() == "application/json"


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The request body is larger than this server's limit of {limit} bytes.",
        413,
        "invalid_request_error",
        code="request_too_large",
    )


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        """`api_key`: None serves `/v1/*` without a key."""
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        limit = self.max_body_bytes
        error = self._check_key(scope, headers, self.api_key)
        if error is None and scope.get("method") in _BODY_METHODS:
            error = self._check_headers(headers, limit)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        if scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        body = await self._read_body(receive, limit)
        if body is None:  # the client went away mid-body: nobody to answer
            return
        if len(body) > limit:
            await _too_large(limit).response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def _check_key(scope: Scope, headers: dict[bytes, bytes], api_key: str | None) -> OpenAIError | None:
        path: str = scope.get("path", "")
        if api_key is None or not (path == "/v1" or path.startswith("/v1/")):
            return None
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode()):
            return None
        return OpenAIError(
            "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            401,
            "invalid_request_error",
            code="invalid_api_key",
        )

    @staticmethod
    def _check_headers(headers: dict[bytes, bytes], limit: int) -> OpenAIError | None:
        if not _is_json(headers.get(b"content-type")):
            return OpenAIError(
                "Send the request body as JSON, with `Content-Type: application/json`.",
                415,
                "invalid_request_error",
                code="unsupported_media_type",
            )
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0  # the HTTP server refuses a malformed length; the count below still holds
        return _too_large(limit) if declared > limit else None

    @staticmethod
    async def _read_body(receive: Receive, limit: int) -> bytes | None:
        """The whole body, or its first `limit + 1` bytes once it is longer (enough to refuse it)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk: bytes = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > limit or not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the route the body already read, then the client's own messages
    (a disconnect, which streaming responses watch for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
