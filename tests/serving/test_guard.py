"""The front door's pure parts, without Ray: RequestGuard's order (401, 415, 413) on a real FastAPI app
built by `build_api`, request-id validation in the ingress and in Serve's proxy, and the settings that
carry the body limit from the command line to the guard. Milliseconds each."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import FastAPI

from raytp.cli.main import build_parser
from raytp.cli.serve import serve_args_of
from raytp.openai.app import build_api
from raytp.openai.chat_settings import ChatSettings
from raytp.openai.guard import DEFAULT_MAX_BODY_BYTES
from raytp.openai.protocol import DetokenizeRequest
from raytp.openai.request_id import MAX_LEN, ProxyRequestIdGuard, is_safe, request_id_of
from raytp.serve.args import ServeArgs

KEY = "k"
AUTH = (b"authorization", b"Bearer k")
JSON = (b"content-type", b"application/json")


def make_app(api_key: str | None = KEY, max_body_bytes: int = 1000) -> FastAPI:
    app = build_api(api_key, max_body_bytes)

    @app.post("/v1/echo")
    async def echo(body: DetokenizeRequest) -> dict[str, Any]:
        return {"tokens": body.tokens}

    return app


def call(
    app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes] | None = None
) -> tuple[int, dict[str, Any]]:
    """One request through the ASGI app, the body sent in `chunks` (no Content-Length: counted as it comes)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks or [b""]) - 1}
        for i, c in enumerate(chunks or [b""])
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_guard_order_key_then_content_type_then_size() -> None:
    app = make_app()
    body = json.dumps({"tokens": [1, 2]}).encode()
    assert call(app, "POST", "/v1/echo", [AUTH, JSON], [body]) == (200, {"tokens": [1, 2]})
    # no key: 401 whatever else is wrong (routes and limits cannot be probed)
    status, err = call(app, "POST", "/v1/echo", [(b"content-type", b"text/plain")], [b"x" * 5000])
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    assert call(app, "GET", "/v1/unknown", [])[0] == 401
    assert call(app, "GET", "/v1/unknown", [AUTH])[0] == 404
    # key, wrong type: 415 before the size is looked at
    for content_type in (b"text/plain", b"application/x-www-form-urlencoded", b"application/jsonx"):
        status, err = call(app, "POST", "/v1/echo", [AUTH, (b"content-type", content_type)], [b"x" * 5000])
        assert status == 415 and err["error"]["code"] == "unsupported_media_type"
    assert call(app, "POST", "/v1/echo", [AUTH], [body])[0] == 415  # no Content-Type at all
    charset = (b"content-type", b"application/json; charset=utf-8")
    assert call(app, "POST", "/v1/echo", [AUTH, charset], [body])[0] == 200


def test_guard_body_limit_declared_and_streamed() -> None:
    app = make_app(max_body_bytes=1000)
    big = json.dumps({"tokens": [1] * 600}).encode()  # 1,814 bytes
    status, err = call(app, "POST", "/v1/echo", [AUTH, JSON, (b"content-length", str(len(big)).encode())], [big])
    assert status == 413 and err["error"]["code"] == "request_too_large" and "1000 bytes" in err["error"]["message"]
    chunks = [big[i : i + 100] for i in range(0, len(big), 100)]  # no Content-Length: counted as it arrives
    assert call(app, "POST", "/v1/echo", [AUTH, JSON], chunks)[0] == 413
    small = json.dumps({"tokens": [1] * 300}).encode()  # 914 bytes, in pieces
    status, payload = call(
        app, "POST", "/v1/echo", [AUTH, JSON], [small[i : i + 100] for i in range(0, len(small), 100)]
    )
    assert status == 200 and payload == {"tokens": [1] * 300}


def test_guard_without_a_key_still_checks_type_and_size() -> None:
    app = make_app(api_key=None, max_body_bytes=10)
    assert call(app, "POST", "/v1/echo", [(b"content-type", b"text/plain")], [b"{}"])[0] == 415
    assert call(app, "POST", "/v1/echo", [JSON], [b'{"tokens": [1, 2, 3]}'])[0] == 413


def test_request_ids() -> None:
    assert is_safe("cmpl-3f2a") and is_safe("a" * MAX_LEN) and is_safe("trace:1/2+x=y~z_.")
    for bad in ("", "a" * (MAX_LEN + 1), "a b", "<x>", "é", "a\x00", "a\n"):
        assert not is_safe(bad), bad
    assert request_id_of([(b"x-request-id", b"abc")]) == "abc"
    assert request_id_of([(b"X-Request-Id", b"abc")]) == "abc"
    for headers in ([], [(b"x-request-id", b"<bad>")], [(b"x-request-id", b"a"), (b"x-request-id", b"b")]):
        rid = request_id_of(headers)
        assert is_safe(rid) and rid not in ("<bad>", "a", "b")


def test_proxy_guard_leaves_one_safe_request_id() -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(list(scope["headers"]))

    def through(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
        asyncio.run(ProxyRequestIdGuard(app)({"type": "http", "headers": headers}, None, None))  # type: ignore[arg-type]
        return [v for k, v in seen[-1] if k.lower() == b"x-request-id"]

    assert through([(b"x-request-id", b"keep-me")]) == [b"keep-me"]
    assert through([(b"host", b"h")]) == []  # none sent: Serve's own middleware makes one
    for bad in ([(b"x-request-id", b"x" * 5000)], [(b"x-request-id", b"a"), (b"X-Request-Id", b"b")]):
        (replaced,) = through(bad)
        assert is_safe(replaced.decode()) and replaced not in (b"a", b"b")
    assert (b"host", b"h") in seen[1]


def test_body_limit_setting_from_flag_to_app() -> None:
    args = build_parser().parse_args(["serve", "--max-request-body-bytes", "12345"])
    assert ServeArgs.from_dict(serve_args_of(args)).max_request_body_bytes == 12345
    default = build_parser().parse_args(["serve"])
    assert ServeArgs.from_dict(serve_args_of(default)).max_request_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 << 20
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        ServeArgs(max_request_body_bytes=0)


def test_every_serve_arg_is_a_flag_and_unset_flags_keep_its_defaults() -> None:
    import dataclasses

    from raytp.serve.args import ModelArgs

    own = [f.name for f in dataclasses.fields(ServeArgs) if f.name != "models"]
    own += [f.name for f in dataclasses.fields(ModelArgs) if f.name not in ("engine", "chat")]
    own += [f.name for f in dataclasses.fields(ChatSettings)]  # the chat flags are flat, as the engine's
    default = build_parser().parse_args(["serve"])
    assert all(getattr(default, name) is None for name in own)  # unset: the dataclasses' own defaults apply
    assert ServeArgs.from_dict(serve_args_of(default)) == ServeArgs()
    args = build_parser().parse_args(
        ["serve", "--split-ingress", "--ingress-replicas", "2", "--autoscaling-config", '{"max_replicas": 3}']
        + ["--health-check-period-s", "1.5", "--max-ongoing-requests", "7"]
    )
    sa = ServeArgs.from_dict(serve_args_of(args))
    assert (sa.split_ingress, sa.ingress_replicas, sa.model.autoscaling_config) == (True, 2, {"max_replicas": 3})
    assert (sa.model.health_check_period_s, sa.model.max_ongoing_requests) == (1.5, 7)
    chat = ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    sa = ServeArgs.from_dict(serve_args_of(build_parser().parse_args(chat)))
    assert sa.model.chat == ChatSettings(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ServeArgs.from_dict(serve_args_of(build_parser().parse_args(["serve", "--enable-auto-tool-choice"])))
