"""The pooling routes' handlers over a real in-process pooling engine (no Ray, no HTTP): the response
bodies (`/v1/embeddings` float and base64, `/v1/score`, `/v1/rerank`), parity with sentence-transformers,
and the refusals."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")

from cluster.config import EngineConfig  # noqa: E402
from cluster.engine import LLMEngine  # noqa: E402
from cluster.outputs import RequestDelta  # noqa: E402
from raytp.openai.context import ServingContext, max_token_chars  # noqa: E402
from raytp.openai.engine_client import EngineRequest  # noqa: E402
from raytp.openai.errors import OpenAIError, to_openai_error  # noqa: E402
from raytp.openai.routes import ROUTES_BY_PATH, handlers  # noqa: E402
from tests.helpers.tiny_pooling import TEXTS, make_cross_encoder, make_st_encoder  # noqa: E402


class InProcessClient:
    """The EngineClient protocol over an offline engine: whichever request waits steps the engine, and each
    step's deltas go to their own request's queue (requests of one call share steps)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.queues: dict[str, list[RequestDelta]] = {}

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        request_id, prompt_token_ids, params = request.request_id, request.prompt_token_ids, request.params
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params)
        queue = self.queues[request_id] = []
        done = False
        while not done:
            await asyncio.sleep(0)  # let the call's other requests be added first
            if not queue:
                for delta in self.engine.step():
                    self.queues[delta.request_id].append(delta)
                continue
            delta = queue.pop(0)
            done = delta.finished
            yield delta
        del self.queues[request_id]

    async def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)


def _context(path: str, name: str, **engine_args: Any) -> ServingContext:
    engine = LLMEngine(EngineConfig(model=path, **engine_args))
    tok = engine.tokenizer
    return ServingContext(
        InProcessClient(engine), tok, name, engine.max_model_len, engine.model_config.vocab_size,  # type: ignore[arg-type]
        max_token_chars(tok), pooling_task=engine.pooling_task,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("pooling-routes"))
    return {"embed": make_st_encoder(root, "bert", "mean"), "rerank": make_cross_encoder(root, "bert")}


def _call(ctx: ServingContext, path: str, body: dict[str, Any]) -> Any:
    route = ROUTES_BY_PATH[path]

    async def run() -> Any:
        try:
            return (await handlers(ctx)[path].create(route.parse(body), "req-1")).model_dump()
        except Exception as e:  # what the HTTP app maps to its error body
            err = e if isinstance(e, OpenAIError) else to_openai_error(e)
            return {"status": err.status, "message": err.message, "param": err.param}

    return asyncio.run(run())


def test_embeddings_float_and_base64(dirs: dict[str, str]) -> None:
    from sentence_transformers import SentenceTransformer

    ctx = _context(dirs["embed"], "embed")
    ref = SentenceTransformer(dirs["embed"], device="cpu").encode(TEXTS, normalize_embeddings=True)
    floats = _call(ctx, "/v1/embeddings", {"input": TEXTS})
    ours = np.array([d["embedding"] for d in floats["data"]])
    assert ((ours * ref).sum(1) >= 0.9999).all()
    assert floats["object"] == "list" and floats["model"] == "embed"
    assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > len(TEXTS)
    b64 = _call(ctx, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"})
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    np.testing.assert_array_equal(decoded, ours.astype(np.float32))
    ids = [ctx.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    by_ids = _call(ctx, "/v1/embeddings", {"input": ids, "dimensions": 8, "normalize": False})
    assert [len(d["embedding"]) for d in by_ids["data"]] == [8, 8]
    for body, param, reason in [
        ({"input": []}, "input", "must not be empty"),
        ({"input": "cat " * 1000}, "input", "maximum context length"),  # refused before tokenizing
        ({"input": "cat " * 200}, "input", "maximum input length is 128 tokens"),
        ({"input": [[5] * 200]}, "input", "maximum input length"),
        ({"input": "hi", "dimensions": 65}, "dimensions", "embedding size"),
        ({"input": [[1, 2, 10**6]]}, "input", "vocabulary size"),
    ]:
        err = _call(ctx, "/v1/embeddings", body)
        assert (err["status"], err["param"]) == (400, param) and reason in err["message"], err
    err = _call(ctx, "/v1/completions", {"prompt": "hi"})
    assert (err["status"], err["param"]) == (400, "model") and "does not generate text" in err["message"], err
    err = _call(ctx, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert err["status"] == 400 and "no chat template" in err["message"], err  # an encoder has none
    assert _call(ctx, "/v1/embeddings", {"input": "hi"})["data"]  # and it serves on
    assert ctx.client.engine.block_manager.num_free_device_blocks == ctx.client.engine.block_manager.num_device_blocks  # type: ignore[attr-defined]


def test_score_and_rerank(dirs: dict[str, str]) -> None:
    from sentence_transformers import CrossEncoder

    ctx = _context(dirs["rerank"], "rerank")
    query = "what is the capital of france?"
    ref = CrossEncoder(dirs["rerank"], device="cpu").predict([(query, t) for t in TEXTS])
    score = _call(ctx, "/v1/score", {"text_1": query, "text_2": TEXTS})
    np.testing.assert_allclose([d["score"] for d in score["data"]], ref, atol=1e-4)
    rerank = _call(ctx, "/v1/rerank", {"query": query, "documents": TEXTS, "top_n": 2, "return_documents": False})
    order = list(np.argsort(-ref, kind="stable")[:2])
    assert [r["index"] for r in rerank["results"]] == order
    assert all(r["document"] is None for r in rerank["results"])
    err = _call(ctx, "/v1/embeddings", {"input": "hi"})
    assert err["status"] == 400 and "cannot serve task 'embed'" in err["message"]
    err = _call(ctx, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]})
    assert (err["status"], err["param"]) == (400, "text_2")


def test_truncate_prompt_tokens(dirs: dict[str, str]) -> None:
    """vLLM's field on all three routes: texts cut by the tokenizer from the left (special tokens kept),
    token ids keep their last ids, -1 the model's length (128); the references truncate the same way."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    long_text = "the cat sat on the mat. " * 40  # 280 tokens
    ctx = _context(dirs["embed"], "embed")
    st = SentenceTransformer(dirs["embed"], device="cpu")
    st.max_seq_length, st.tokenizer.truncation_side = 16, "left"
    cut = _call(ctx, "/v1/embeddings", {"input": [long_text, "paris"], "truncate_prompt_tokens": 16})
    ours = np.array([d["embedding"] for d in cut["data"]])
    np.testing.assert_allclose((ours * st.encode([long_text, "paris"], normalize_embeddings=True)).sum(1), 1, atol=1e-4)
    assert cut["usage"]["prompt_tokens"] == 16 + 3
    whole = _call(ctx, "/v1/embeddings", {"input": "cat " * 1000, "truncate_prompt_tokens": -1})  # no char guard
    assert whole["usage"]["prompt_tokens"] == 128, whole
    token_ids = [5 + i % 80 for i in range(200)]
    ids = _call(ctx, "/v1/embeddings", {"input": [token_ids], "truncate_prompt_tokens": 10})
    by_tail = _call(ctx, "/v1/embeddings", {"input": [token_ids[-10:]]})
    assert ids["data"][0]["embedding"] == by_tail["data"][0]["embedding"] and ids["usage"]["prompt_tokens"] == 10
    for value, reason in [(129, "greater than this model's maximum input length (128)"), (0, "must be -1")]:
        err = _call(ctx, "/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": value})
        assert (err["status"], err["param"]) == (400, "truncate_prompt_tokens") and reason in err["message"], err
    err = _call(ctx, "/v1/score", {"text_1": long_text, "text_2": "paris", "truncate_prompt_tokens": 200})
    assert (err["status"], err["param"]) == (400, "truncate_prompt_tokens"), err

    ctx = _context(dirs["rerank"], "rerank")
    query, docs = "what is the capital of france?", [long_text, "paris", "berlin"]
    ce = CrossEncoder(dirs["rerank"], device="cpu", max_length=20)
    ce.tokenizer.truncation_side = "left"
    ref = ce.predict([(query, d) for d in docs])
    err = _call(ctx, "/v1/rerank", {"query": query, "documents": docs})
    assert err["status"] == 400 and "maximum context length is 128" in err["message"], err  # before tokenizing
    rerank = _call(ctx, "/v1/rerank", {"query": query, "documents": docs, "truncate_prompt_tokens": 20})
    by_index = {r["index"]: r["relevance_score"] for r in rerank["results"]}
    np.testing.assert_allclose([by_index[i] for i in range(3)], ref, atol=1e-4)
    score = _call(ctx, "/v1/score", {"text_1": query, "text_2": docs, "truncate_prompt_tokens": 20})
    np.testing.assert_allclose([d["score"] for d in score["data"]], ref, atol=1e-4)


def test_rerank_with_a_qwen3_reranker(tmp_path: Path) -> None:
    """The original Qwen3-Reranker shape under vLLM's hf_overrides: /v1/rerank orders the documents by HF's
    softmax([logit_no, logit_yes])[1] at each pair's last token, and /v1/score returns it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.tiny_pooling import QWEN3_RERANKER_OVERRIDES, make_qwen3_reranker

    path = make_qwen3_reranker(tmp_path)
    ctx = _context(path, "reranker", hf_overrides=QWEN3_RERANKER_OVERRIDES)
    query, docs = "<Query>: capital of france?\n", ["<Document>: paris", "<Document>: no idea", "yes yes"]
    tok, hf = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        last = [hf(torch.tensor([tok(query, d)["input_ids"]])).logits[0, -1] for d in docs]
    ref = np.array([torch.softmax(logits[[no, yes]], dim=0)[1].item() for logits in last])
    rerank = _call(ctx, "/v1/rerank", {"query": query, "documents": docs})
    assert [r["index"] for r in rerank["results"]] == list(np.argsort(-ref, kind="stable"))
    np.testing.assert_allclose([r["relevance_score"] for r in rerank["results"]], np.sort(ref)[::-1], atol=1e-4)
    assert rerank["usage"]["prompt_tokens"] == sum(len(tok(query, d)["input_ids"]) for d in docs)
    score = _call(ctx, "/v1/score", {"text_1": query, "text_2": docs})
    np.testing.assert_allclose([d["score"] for d in score["data"]], ref, atol=1e-4)
    err = _call(ctx, "/v1/embeddings", {"input": "hi"})
    assert err["status"] == 400 and "cannot serve task 'embed'" in err["message"], err
