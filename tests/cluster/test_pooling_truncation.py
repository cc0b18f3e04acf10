"""truncate_prompt_tokens on pooling requests, offline (vLLM's semantics): unset, an input over the model's
length is refused naming the length; set, text inputs are cut by the tokenizer from the left (its special
tokens kept, as vLLM's left-truncating tokenizer does) and token-id inputs keep their last ids; -1 is the
model's length. References: sentence-transformers' encode and CrossEncoder.predict with the same tokenizer
truncating from the left at the same length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")

from raytp import LLM, RequestError  # noqa: E402
from request.errors import PromptTooLongError  # noqa: E402
from request.pooling_params import PoolingParams  # noqa: E402
from tests.helpers.tiny_pooling import make_cross_encoder, make_st_encoder  # noqa: E402

MAX_LEN = 32
LONG = "the cat sat on the mat and the dog sat on paris, " * 4  # ~50 tokens: over MAX_LEN
TEXTS = [LONG, "what is the capital of france?", "q"]
CLS, SEP = 2, 3  # tests/helpers/tiny_pooling.py's vocabulary


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("pooling-trunc"))
    return {"embed": make_st_encoder(root, "bert", "cls"), "rerank": make_cross_encoder(root, "bert")}


@pytest.fixture(scope="module")
def llm(dirs: dict[str, str]) -> LLM:
    llm = LLM(dirs["embed"], runner="pooling", max_model_len=MAX_LEN)
    yield llm
    llm.llm_engine.shutdown()


def _left_truncating_st(path: str, keep: int):  # type: ignore[no-untyped-def]
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu")
    st.max_seq_length = keep
    st.tokenizer.truncation_side = "left"
    return st


def test_unset_refuses_an_input_over_the_length_naming_it(llm: LLM) -> None:
    with pytest.raises(PromptTooLongError, match=f"maximum input length is {MAX_LEN} tokens.*truncate_prompt_tokens"):
        llm.embed([LONG], use_tqdm=False)
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("keep", [8, MAX_LEN])
def test_texts_keep_their_end_and_special_tokens(llm: LLM, dirs: dict[str, str], keep: int) -> None:
    """CLS pooling: a truncation that dropped [CLS] would differ from the reference at once."""
    outs = llm.embed(TEXTS, use_tqdm=False, truncate_prompt_tokens=keep)
    ref = _left_truncating_st(dirs["embed"], keep).encode(TEXTS, normalize_embeddings=True)
    ours = np.array([o.outputs.embedding for o in outs])
    np.testing.assert_allclose((ours * ref).sum(1), 1.0, atol=1e-4)
    long_ids = outs[0].prompt_token_ids
    assert len(long_ids) == keep and long_ids[0] == CLS and long_ids[-1] == SEP
    full = llm.get_tokenizer()(LONG, truncation=False)["input_ids"]
    assert long_ids[1:-1] == full[-(keep - 1) : -1]  # the text's last tokens
    whole = [len(llm.get_tokenizer()(t)["input_ids"]) for t in TEXTS[1:]]
    assert [len(o.prompt_token_ids) for o in outs[1:]] == [min(n, keep) for n in whole]
    # the PoolingParams field does the same as the keyword; -1 is the model's length
    by_params = llm.embed(TEXTS[:1], PoolingParams(truncate_prompt_tokens=keep), use_tqdm=False)
    assert by_params[0].outputs.embedding == outs[0].outputs.embedding
    if keep == MAX_LEN:
        minus_one = llm.embed(TEXTS[:1], use_tqdm=False, truncate_prompt_tokens=-1)
        assert minus_one[0].outputs.embedding == outs[0].outputs.embedding
    _assert_all_blocks_free(llm)


def test_token_ids_keep_their_last_ids(llm: LLM) -> None:
    ids = list(range(5, 5 + 40))
    out = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False, truncate_prompt_tokens=6)[0]
    assert out.prompt_token_ids == ids[-6:]
    direct = llm.embed([{"prompt_token_ids": ids[-6:]}], use_tqdm=False)[0]
    assert out.outputs.embedding == direct.outputs.embedding


def test_bad_values_are_refused_by_name(llm: LLM) -> None:
    for keep, reason in [
        (MAX_LEN + 1, f"greater than this model's maximum input length \\({MAX_LEN}\\)"),
        (0, "must be -1"),
        (-2, "must be -1"),
        (1, "leaves no room"),  # [CLS] and [SEP] alone are 2 tokens
    ]:
        with pytest.raises(RequestError, match=reason) as info:
            llm.embed(TEXTS, use_tqdm=False, truncate_prompt_tokens=keep)
        assert info.value.param == "truncate_prompt_tokens"
    _assert_all_blocks_free(llm)
    assert llm.embed(["paris"], use_tqdm=False)[0].outputs.embedding  # and it serves on


def test_cross_encoder_pairs_are_cut_longest_first_from_the_left(dirs: dict[str, str]) -> None:
    from sentence_transformers import CrossEncoder

    keep = 12
    query, docs = "what is the capital of france?", [LONG, "paris", "berlin is the capital of what?"]
    ce = CrossEncoder(dirs["rerank"], device="cpu", max_length=keep)
    ce.tokenizer.truncation_side = "left"
    ref = ce.predict([(query, d) for d in docs])
    llm = LLM(dirs["rerank"], max_model_len=MAX_LEN)
    try:
        with pytest.raises(PromptTooLongError, match="maximum input length"):
            llm.score(query, docs, use_tqdm=False)
        outs = llm.score(query, docs, use_tqdm=False, truncate_prompt_tokens=keep)
        np.testing.assert_allclose([o.outputs.score for o in outs], ref, atol=1e-4)
        assert len(outs[0].prompt_token_ids) == keep
        _assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()


def test_embedding_model_scores_truncate_each_text(llm: LLM) -> None:
    keep = 10
    scores = [o.outputs.score for o in llm.score(LONG, TEXTS[1:], use_tqdm=False, truncate_prompt_tokens=keep)]
    vectors = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False, truncate_prompt_tokens=keep)])
    np.testing.assert_allclose(scores, vectors[1:] @ vectors[0], atol=1e-5)


def _assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks
    assert not llm.llm_engine.has_unfinished_requests()
