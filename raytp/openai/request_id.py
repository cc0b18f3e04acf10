"""Request ids: the client's `X-Request-Id` if it is safe, else a fresh one; the same id in the
response header, the body's `id` and the server log.

Ray Serve's HTTP proxy echoes the incoming `X-Request-Id` header into every response (and its access
log) before any application code runs, so a header of any length and charset would come back as
sent. Two layers keep that from happening:

- `ProxyRequestIdGuard` runs *in the proxy*, outside Serve's own request-id middleware (Serve's
  `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` hook, set by `enable_proxy_guard` before Ray starts):
  an unsafe or repeated header is replaced by a fresh id, so the proxy only ever echoes safe ids.
- `request_id_of` runs in the ingress: the header the proxy forwarded (always present: Serve adds a
  generated one when the client sent none) if it is safe, else a fresh id. Behind a proxy without
  the guard (a cluster started elsewhere) the body id is still safe, but the echoed header is Serve's.

Decision: the body's `id` is `<prefix>-<request id>` (`cmpl-...`, `chatcmpl-...`), as vLLM builds it
from the same header, so OpenAI-style ids keep their prefix and the header is found in the body.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_LEN = 128
# Letters, digits and the punctuation of UUIDs, ULIDs, base64 and trace ids: nothing a log line,
# a header or an HTML page would interpret.
_SAFE = re.compile(rf"[A-Za-z0-9._:+=/~-]{{1,{MAX_LEN}}}")
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "raytp.openai.request_id:proxy_middlewares"


def is_safe(value: str) -> bool:
    return _SAFE.fullmatch(value) is not None


def new_request_id() -> str:
    return uuid.uuid4().hex


def _header_values(headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    return [v for k, v in headers if k.lower() == HEADER]


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The request's id from its ASGI headers: the single safe `X-Request-Id`, else a fresh one."""
    values = _header_values(headers)
    if len(values) == 1:
        value = values[0].decode("latin-1")
        if is_safe(value):
            return value
    return new_request_id()


class ProxyRequestIdGuard:
    """ASGI middleware for Serve's HTTP proxy: leaves exactly one safe `X-Request-Id` in the request
    (the client's, or a fresh one), which Serve's request-id middleware then echoes and logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or [])
            values = _header_values(headers)
            if values and (len(values) > 1 or not is_safe(values[0].decode("latin-1"))):
                kept = [(k, v) for k, v in headers if k.lower() != HEADER]
                scope = {**scope, "headers": [*kept, (HEADER, new_request_id().encode())]}
        await self.app(scope, receive, send)


def proxy_middlewares() -> list[Middleware]:
    """Serve's proxy callback (`PROXY_CALLBACK`): the middlewares the HTTP proxy wraps around Serve's own."""
    return [Middleware(ProxyRequestIdGuard)]


def enable_proxy_guard() -> None:
    """Install `ProxyRequestIdGuard` in the HTTP proxies of a Ray cluster this process is about to start
    (they inherit this environment). A callback the operator set already is left in place."""
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
