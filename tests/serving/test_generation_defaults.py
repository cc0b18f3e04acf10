"""The model's generation_config.json over HTTP (issue 28, must-show 5): chat and completion fields a request
omits or sends as null take the model's defaults, fields it sets win, and max_new_tokens is the length of a
request that sets none. Checked by seeded sampling: a request relying on the defaults samples exactly what a
request spelling them out does, and not what raytp's built-in defaults sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.helpers.tiny_models import make_tiny_llama
from tests.serving.live_server import SMALL_ENGINE, LiveServer, live_server

DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 3, "min_p": 0.05, "repetition_penalty": 1.2}
MAX_NEW = 12
BUILTIN = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
MESSAGES = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = Path(make_tiny_llama(tmp_path_factory.mktemp("gen-http")))
    gen = model / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), **DEFAULTS, "max_new_tokens": MAX_NEW}))
    with live_server({**SMALL_ENGINE, "model": str(model)}) as s:
        yield s


def _post(server: LiveServer, route: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = requests.post(server.url(route), json={"model": server.model_info().model, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def _chat(server: LiveServer, **fields: Any) -> tuple[str, int]:
    out = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "seed": 11, "ignore_eos": True, **fields})
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]


def test_chat_fields_left_unset_take_the_models_defaults(server: LiveServer) -> None:
    assert server.model_info().generation_defaults == {**DEFAULTS, "max_tokens": MAX_NEW}
    implicit, n = _chat(server)
    assert n == MAX_NEW  # the model's max_new_tokens, not "as many as fit"
    assert _chat(server, **DEFAULTS, max_tokens=MAX_NEW) == (implicit, n)
    assert _chat(server, **dict.fromkeys(DEFAULTS), max_tokens=None) == (implicit, n)  # null: the default
    assert _chat(server, **BUILTIN, max_tokens=MAX_NEW)[0] != implicit  # the defaults do change sampling
    assert _chat(server, max_tokens=5)[1] == 5  # a field the request sets wins


def test_completion_fields_left_unset_take_the_models_defaults(server: LiveServer) -> None:
    body = {"prompt": "once upon a time", "seed": 5, "max_tokens": 10, "ignore_eos": True}
    implicit = _post(server, "/v1/completions", body)["choices"][0]["text"]
    assert _post(server, "/v1/completions", {**body, **DEFAULTS})["choices"][0]["text"] == implicit
    assert _post(server, "/v1/completions", {**body, **BUILTIN})["choices"][0]["text"] != implicit
