"""A chat model and an embedding model in one Serve application (the multi-model config, as
serve_config.multi.example.yaml has them): both answer over HTTP, `/v1/models` lists both, the official
openai client's `embeddings.create` (float and base64) matches sentence-transformers, truncate_prompt_tokens
works live, and each model refuses the other's endpoint with a 400 naming why, serving on afterwards.

Kept cheap for the shared 2-core machine: two tiny random models, 16 MiB KV pools and no swap space (the
earlier three-model version, with default KV budgets, was OOM-killed there).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import yaml

pytest.importorskip("sentence_transformers")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from raytp.cli.serve import config_args  # noqa: E402
from tests.helpers.tiny_models import make_tiny_llama  # noqa: E402
from tests.helpers.tiny_pooling import TEXTS, make_st_encoder  # noqa: E402
from tests.serving.live_server import APP, LiveServer, live_server  # noqa: E402

SMALL = {"kv_cache_memory_bytes": 1 << 24, "swap_space": 0.0}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("pooling-live"))
    return {"chat": make_tiny_llama(root), "embed": make_st_encoder(root, "bert", "mean")}


@pytest.fixture(scope="module")
def reference(dirs: dict[str, str]) -> np.ndarray:
    """sentence-transformers' embeddings, computed before the server takes the machine's CPUs."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(dirs["embed"], device="cpu").encode(TEXTS, normalize_embeddings=True)


@pytest.fixture(scope="module")
def server(dirs: dict[str, str], reference: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> Any:
    models = [
        {"model": dirs["chat"], "served_model_name": "chat", "max_model_len": 256, **SMALL},
        {"model": dirs["embed"], "served_model_name": "embed", "runner": "pooling", **SMALL},
    ]
    config = {
        "applications": [
            {"name": APP, "route_prefix": "/", "import_path": "serve_app:build_app", "args": {"models": models}}
        ]
    }
    path = tmp_path_factory.mktemp("config") / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))  # Serve accepts the file
    with live_server(config_args(str(path))) as s:  # the args `raytp serve --config` takes from it
        yield s


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(server.url(path), json=body, timeout=120)


def test_models_lists_both_and_both_answer(server: LiveServer, reference: np.ndarray) -> None:
    ids = [m["id"] for m in requests.get(server.url("/v1/models"), timeout=30).json()["data"]]
    assert ids == ["chat", "embed"]
    chat = _post(server, "/v1/chat/completions",
                 {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["model"] == "chat", chat.text
    assert chat.json()["usage"]["completion_tokens"] > 0
    client = server.client()
    # unset: the client asks for base64 itself and decodes it; asked for explicitly, it hands the string over
    for encoding_format in (None, "float", "base64"):
        extra = {} if encoding_format is None else {"encoding_format": encoding_format}
        resp = client.embeddings.create(model="embed", input=TEXTS, **extra)  # type: ignore[arg-type]
        if encoding_format == "base64":
            ours = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in resp.data])
        else:
            ours = np.array([d.embedding for d in resp.data], dtype=np.float32)
        assert ((ours * reference).sum(1) >= 0.9999).all(), encoding_format
        assert resp.model == "embed" and resp.usage.prompt_tokens > len(TEXTS)


def test_truncate_prompt_tokens_live(server: LiveServer) -> None:
    long_text = "cat " * 200  # 202 tokens, over the encoder's 128 (and few enough characters to be tokenized)
    refused = _post(server, "/v1/embeddings", {"model": "embed", "input": long_text})
    assert refused.status_code == 400 and "maximum input length is 128" in refused.json()["error"]["message"]
    cut = _post(server, "/v1/embeddings", {"model": "embed", "input": long_text, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 128, cut.text


def test_each_model_refuses_the_others_endpoint_and_both_serve_on(server: LiveServer) -> None:
    cases = [
        ("/v1/embeddings", {"model": "chat", "input": "hi"}, "runs generation: it does not serve embeddings"),
        ("/v1/score", {"model": "chat", "text_1": "a", "text_2": "b"}, "runs generation"),
        ("/v1/completions", {"model": "embed", "prompt": "hi", "max_tokens": 2}, "does not generate text"),
        ("/v1/chat/completions", {"model": "embed", "messages": [{"role": "user", "content": "hi"}]},
         "no chat template"),  # an encoder has none
    ]  # fmt: skip
    for path, body, reason in cases:
        r = _post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        assert reason in r.json()["error"]["message"], (path, r.text)
    assert _post(server, "/v1/embeddings", {"model": "embed", "input": "hi"}).status_code == 200
    assert _post(server, "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 2}).status_code == 200
