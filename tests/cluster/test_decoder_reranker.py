"""Decoder rerankers (Qwen3ForSequenceClassification), offline, against Hugging Face transformers in fp32:

- the original Qwen3-Reranker shape (a causal LM) turned on as vLLM users do, with hf_overrides
  {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
  "is_original_qwen3_reranker": true}: each pair's score equals HF's softmax([logit_no, logit_yes])[1] at the
  last token within 1e-4, tied and untied LM heads;
- a converted checkpoint with its own one-label score head: sigmoid of HF's logit;
- bad overrides refused at start, naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from raytp import LLM, RequestError
from tests.helpers.tiny_pooling import (
    QWEN3_RERANKER_OVERRIDES,
    make_qwen3_reranker,
    make_qwen3_seq_cls,
)

QUERY = "<Query>: what is the capital of france?\n"
DOCS = ["<Document>: paris is. yes", "<Document>: berlin, no", "no no no", "yes"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("decoder-reranker"))
    return {
        "tied": make_qwen3_reranker(root, tied=True),
        "untied": make_qwen3_reranker(root, tied=False, seed=1),
        "seq-cls": make_qwen3_seq_cls(root),
    }


def _scores(llm: LLM, query: str, docs: list[str]) -> tuple[list[float], list[list[int]]]:
    outs = llm.score(query, docs, use_tqdm=False)
    return [o.outputs.score for o in outs], [o.prompt_token_ids for o in outs]


def _hf_last_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_original_qwen3_reranker_scores_are_the_yes_probability(dirs: dict[str, str], head: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = dirs[head]
    tok = AutoTokenizer.from_pretrained(path)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    assert (no, yes) == (261, 260)  # single tokens of the tiny BPE, as in Qwen's vocabulary
    llm = LLM(path, hf_overrides=QWEN3_RERANKER_OVERRIDES)  # runner auto: a score model pools
    try:
        assert llm.llm_engine.config.runner == "pooling" and llm.llm_engine.pooling_task == "score"
        scores, prompts = _scores(llm, QUERY, DOCS)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ref = []
        for doc, ids in zip(DOCS, prompts, strict=True):
            assert ids == tok(QUERY, doc)["input_ids"]  # the tokenizer's pair: the two texts concatenated
            logits = _hf_last_logits(hf, ids)
            ref.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
        np.testing.assert_allclose(scores, ref, atol=1e-4)
        assert max(ref) - min(ref) > 0.05, ref  # the pairs score apart: a wrong token row would show
        bm = llm.llm_engine.block_manager
        assert bm.num_free_device_blocks == bm.num_device_blocks
    finally:
        llm.llm_engine.shutdown()


def test_without_the_overrides_the_folder_is_a_generator(dirs: dict[str, str]) -> None:
    llm = LLM(dirs["tied"])
    try:
        assert llm.llm_engine.config.runner == "generate"
        with pytest.raises(RequestError, match="runs generation"):
            llm.score(QUERY, DOCS[:1], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_a_stored_score_head_is_the_sigmoid_of_hf_logit(dirs: dict[str, str]) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = dirs["seq-cls"]
    llm = LLM(path)  # config.json names Qwen3ForSequenceClassification
    try:
        scores, prompts = _scores(llm, QUERY, DOCS)
    finally:
        llm.llm_engine.shutdown()
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        ref = [torch.sigmoid(hf(torch.tensor([tok(QUERY, d)["input_ids"]])).logits[0, 0]).item() for d in DOCS]
    np.testing.assert_allclose(scores, ref, atol=1e-4)
    assert max(ref) - min(ref) > 0.05, ref


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"is_original_qwen3_reranker": True}, "is_original_qwen3_reranker needs classifier_from_token"),
        ({"classifier_from_token": ["no", "yes"]}, "classifier_from_token needs method"),
        ({**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["nope", "yes"]}, r"\['nope'\] not a single token"),
        ({**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["no", "yes", "x"]}, "from_2_way_softmax takes two"),
        ({**QWEN3_RERANKER_OVERRIDES, "architectures": "Qwen3ForSequenceClassification"}, "architectures must be a"),
    ],
)
def test_bad_overrides_are_refused_at_start(dirs: dict[str, str], overrides: dict[str, Any], reason: str) -> None:
    arch = {"architectures": ["Qwen3ForSequenceClassification"]}
    with pytest.raises(ValueError, match=reason):
        LLM(dirs["tied"], hf_overrides={**arch, **overrides})
