"""The pooling runner end to end, offline: parity with sentence-transformers on the same folders, the
request checks, and the KV blocks a pooling step frees.

Targets (issue 40): embeddings equal SentenceTransformer.encode(..., normalize_embeddings=True), cosine >=
0.9999 in fp32, for a BERT (mean), an XLM-R (CLS) and a decoder (last token); a cross-encoder's scores
equal CrossEncoder.predict within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")

from raytp import LLM, RequestError  # noqa: E402
from request.errors import PromptTooLongError  # noqa: E402
from request.pooling_params import PoolingParams  # noqa: E402
from tests.helpers.tiny_pooling import TEXTS, make_cross_encoder, make_st_decoder, make_st_encoder  # noqa: E402

# lengths 1 .. 60 words: rows of very different lengths in one step (padding in the encoder's attention)
LONG_TEXTS = [*TEXTS, " ".join(["cat"] * 60), "dog " * 17, "q"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("pooling"))
    return {
        "bert-mean": make_st_encoder(root, "bert", "mean"),
        "xlmr-cls": make_st_encoder(root, "xlmr", "cls"),
        "qwen3-last": make_st_decoder(root),
        "ce-bert": make_cross_encoder(root, "bert"),
        "ce-xlmr": make_cross_encoder(root, "xlmr"),
    }


def _st_encode(path: str, texts: list[str], normalize: bool = True) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(texts, normalize_embeddings=normalize)


def _embed(llm: LLM, texts: list[str], params: PoolingParams | None = None) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, params, use_tqdm=False)])


def _assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("name", ["bert-mean", "xlmr-cls", "qwen3-last"])
def test_embeddings_match_sentence_transformers(models: dict[str, str], name: str) -> None:
    ref = _st_encode(models[name], LONG_TEXTS)
    # a small token budget: the texts run over several steps, rows batched by the budget
    llm = LLM(models[name], runner="pooling", max_num_batched_tokens=256)
    ours = _embed(llm, LONG_TEXTS)
    cosines = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosines.min() >= 0.9999, cosines
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # the folder's Normalize module
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_cross_encoder_scores_match_predict(models: dict[str, str], kind: str) -> None:
    from sentence_transformers import CrossEncoder

    path = models[f"ce-{kind}"]
    query = "what is the capital of france?"
    ref = CrossEncoder(path, device="cpu").predict([(query, t) for t in TEXTS])
    llm = LLM(path)  # runner "auto": a cross-encoder can only pool
    assert llm.llm_engine.config.runner == "pooling"
    scores = [o.outputs.score for o in llm.score(query, TEXTS, use_tqdm=False)]
    np.testing.assert_allclose(scores, ref, atol=1e-4)
    # two lists of one length pair up in order
    zipped = [o.outputs.score for o in llm.score([query] * 2, TEXTS[:2], use_tqdm=False)]
    np.testing.assert_allclose(zipped, ref[:2], atol=1e-4)
    _assert_all_blocks_free(llm)


def test_matryoshka_dimensions_and_normalize_override(models: dict[str, str]) -> None:
    raw = _st_encode(models["bert-mean"], TEXTS, normalize=False)  # the folder still has its Normalize
    llm = LLM(models["bert-mean"], runner="pooling")
    truncated = _embed(llm, TEXTS, PoolingParams(dimensions=16))
    assert truncated.shape == (len(TEXTS), 16)
    expected = raw[:, :16] / np.linalg.norm(raw[:, :16], axis=1, keepdims=True)  # truncate, then normalize
    np.testing.assert_allclose(truncated, expected, atol=1e-5)
    unnormalized = _embed(llm, TEXTS, PoolingParams(normalize=False))
    assert not np.allclose(np.linalg.norm(unnormalized, axis=1), 1.0)
    np.testing.assert_allclose(unnormalized / np.linalg.norm(unnormalized, axis=1, keepdims=True), raw, atol=1e-5)


def test_pooler_config_overrides_the_folder(models: dict[str, str]) -> None:
    """The XLM-R folder pools CLS; pooler_config asks for the mean of the same hidden states."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(models["xlmr-cls"], device="cpu")
    hidden = st.encode(TEXTS, output_value="token_embeddings")  # per text: [tokens, hidden], before pooling
    ref = np.array([h.numpy().mean(0) for h in hidden])
    llm = LLM(models["xlmr-cls"], runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False})
    np.testing.assert_allclose(_embed(llm, TEXTS), ref, atol=1e-4)


def test_embedding_model_scores_by_cosine(models: dict[str, str]) -> None:
    llm = LLM(models["bert-mean"], runner="pooling")
    vectors = _embed(llm, TEXTS)
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    np.testing.assert_allclose(scores, vectors[1:] @ vectors[0], atol=1e-5)


def test_bad_requests_are_refused_and_the_engine_serves_on(models: dict[str, str]) -> None:
    llm = LLM(models["bert-mean"], runner="pooling", max_model_len=64)
    with pytest.raises(RequestError, match="must not be empty"):
        llm.embed([TEXTS[0], {"prompt_token_ids": []}], use_tqdm=False)  # the first was queued: aborted
    with pytest.raises(PromptTooLongError, match="maximum input length is 64"):
        llm.embed(["cat " * 100], use_tqdm=False)
    with pytest.raises(RequestError, match="at most the model's embedding size"):
        llm.embed(TEXTS, PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(RequestError, match="does not generate text"):
        llm.generate(TEXTS[0], use_tqdm=False)
    with pytest.raises(RequestError, match="cannot serve task 'score'"):
        llm.embed(TEXTS, PoolingParams(task="score"), use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_device_blocks == bm.num_device_blocks  # refused calls hold nothing, or aborted it
    np.testing.assert_allclose(_embed(llm, TEXTS[:1]), _st_encode(models["bert-mean"], TEXTS[:1]), atol=1e-5)
    _assert_all_blocks_free(llm)


def test_runner_mismatches_name_the_reason(models: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="BertModel is a pooling model .* runner='pooling'"):
        LLM(models["bert-mean"], runner="generate")


def test_generation_model_refuses_pooling_requests(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import make_tiny_llama

    path = make_tiny_llama(tmp_path)
    with pytest.raises(ValueError, match="pooler_config applies to runner='pooling' only"):
        LLM(path, pooler_config={"normalize": True})  # runner auto: a decoder generates
    llm = LLM(path)
    assert llm.llm_engine.config.runner == "generate"
    with pytest.raises(RequestError, match="runs generation: it does not serve embeddings"):
        llm.embed(["hello"], use_tqdm=False)


def test_a_decoder_checkpoint_embeds_with_runner_pooling(tmp_path: Path) -> None:
    """A causal LM's own checkpoint (model.* names, an LM head) embeds by last-token pooling, unnormalized
    (no modules.json): its final hidden state at the last prompt token, as HF's base model computes it."""
    import torch
    from transformers import AutoModel

    from tests.helpers.tiny_models import make_tiny_untied_rope_scaled

    path = make_tiny_untied_rope_scaled(tmp_path)  # untied head: its lm_head tensor must be skipped
    llm = LLM(path, runner="pooling")
    ids = [[5, 9, 14, 200, 7], [33, 3]]
    ours = np.array([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": i} for i in ids], use_tqdm=False)])
    hf = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        ref = np.array([hf(torch.tensor([i])).last_hidden_state[0, -1].numpy() for i in ids])
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
