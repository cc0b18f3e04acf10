"""Pooling models served beside a chat model (the multi-model config): `/v1/embeddings` through the
official openai client (float and base64), `/v1/score` and `/v1/rerank` on a cross-encoder, parity with
sentence-transformers over HTTP, and the refusals (a chat model asked to embed and the reverse, an empty
input, a too-long input) after which every model still answers.
"""

from __future__ import annotations

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
from tests.helpers.tiny_pooling import TEXTS, make_cross_encoder, make_st_encoder  # noqa: E402
from tests.serving.live_server import APP, LiveServer, live_server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("pooling-live"))
    return {
        "chat": make_tiny_llama(root),
        "embed": make_st_encoder(root, "bert", "mean"),
        "rerank": make_cross_encoder(root, "bert"),
    }


@pytest.fixture(scope="module")
def server(dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Any:
    models = [
        {"model": dirs["chat"], "served_model_name": "chat", "max_model_len": 256,
         "kv_cache_memory_bytes": 1 << 24, "swap_space": 0.05},
        {"model": dirs["embed"], "served_model_name": "embed", "runner": "pooling"},
        {"model": dirs["rerank"], "served_model_name": "rerank"},  # runner auto: a cross-encoder pools
    ]  # fmt: skip
    config = {
        "applications": [
            {"name": APP, "route_prefix": "/", "import_path": "serve_app:build_app", "args": {"models": models}}
        ]
    }
    path = tmp_path_factory.mktemp("config") / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    with live_server(config_args(str(path)), num_cpus=8) as s:
        yield s


def _reference(path: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(texts, normalize_embeddings=True)


def test_models_lists_chat_and_pooling_models(server: LiveServer) -> None:
    ids = {m["id"] for m in requests.get(server.url("/v1/models"), timeout=30).json()["data"]}
    assert ids == {"chat", "embed", "rerank"}
    chat = requests.post(
        server.url("/v1/chat/completions"),
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_embeddings_match_sentence_transformers(
    server: LiveServer, dirs: dict[str, str], encoding_format: Any
) -> None:
    resp = server.client().embeddings.create(model="embed", input=TEXTS, encoding_format=encoding_format)
    ours = np.array([d.embedding for d in resp.data], dtype=np.float32)  # the client decodes base64
    ref = _reference(dirs["embed"], TEXTS)
    assert ((ours * ref).sum(1) >= 0.9999).all()
    assert resp.model == "embed" and [d.index for d in resp.data] == list(range(len(TEXTS)))
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(TEXTS)


def test_client_default_encoding_and_token_ids_and_dimensions(server: LiveServer, dirs: dict[str, str]) -> None:
    client = server.client()
    default = client.embeddings.create(model="embed", input=TEXTS[0])  # the client asks for base64 itself
    ids = requests.post(server.url("/tokenize"), json={"model": "embed", "prompt": TEXTS[0]}, timeout=30).json()
    by_ids = client.embeddings.create(model="embed", input=ids["tokens"], encoding_format="float")
    np.testing.assert_allclose(default.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)
    short = client.embeddings.create(model="embed", input=TEXTS[0], dimensions=8, encoding_format="float")
    assert len(short.data[0].embedding) == 8
    assert abs(np.linalg.norm(short.data[0].embedding) - 1.0) < 1e-5


def test_score_and_rerank_match_cross_encoder(server: LiveServer, dirs: dict[str, str]) -> None:
    from sentence_transformers import CrossEncoder

    query = "what is the capital of france?"
    ref = CrossEncoder(dirs["rerank"], device="cpu").predict([(query, t) for t in TEXTS])
    score = requests.post(
        server.url("/v1/score"), json={"model": "rerank", "text_1": query, "text_2": TEXTS}, timeout=120
    ).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], ref, atol=1e-4)
    rerank = requests.post(
        server.url("/v1/rerank"), json={"model": "rerank", "query": query, "documents": TEXTS, "top_n": 3}, timeout=120
    ).json()
    order = list(np.argsort(-ref, kind="stable")[:3])
    assert [r["index"] for r in rerank["results"]] == order
    assert [r["document"]["text"] for r in rerank["results"]] == [TEXTS[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in rerank["results"]], ref[order], atol=1e-4)
    # an embedding model scores by cosine
    cos = requests.post(
        server.url("/v1/score"), json={"model": "embed", "text_1": TEXTS[0], "text_2": TEXTS[1]}, timeout=120
    ).json()
    vecs = _reference(dirs["embed"], TEXTS[:2])
    assert abs(cos["data"][0]["score"] - float(vecs[0] @ vecs[1])) < 1e-4


def test_refusals_are_400s_naming_why_and_every_model_serves_on(server: LiveServer) -> None:
    def post(path: str, body: dict[str, Any]) -> requests.Response:
        return requests.post(server.url(path), json=body, timeout=120)

    cases = [
        (post("/v1/embeddings", {"model": "chat", "input": "hi"}), "runs generation"),
        (post("/v1/chat/completions", {"model": "embed", "messages": [{"role": "user", "content": "hi"}]}),
         "no chat template"),  # an encoder has none
        (post("/v1/completions", {"model": "rerank", "prompt": "hi"}), "does not generate text"),
        (post("/v1/embeddings", {"model": "embed", "input": []}), "must not be empty"),
        (post("/v1/embeddings", {"model": "embed", "input": [[5] * 200]}), "maximum input length"),
        (post("/v1/embeddings", {"model": "rerank", "input": "hi"}), "cannot serve task 'embed'"),
        (post("/v1/score", {"model": "chat", "text_1": "a", "text_2": "b"}), "runs generation"),
    ]  # fmt: skip
    for resp, reason in cases:
        assert resp.status_code == 400, resp.text
        assert reason in resp.json()["error"]["message"], resp.text
    assert post("/v1/embeddings", {"model": "embed", "input": "hi"}).status_code == 200
    assert post("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"]}).status_code == 200
    assert post("/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 2}).status_code == 200
