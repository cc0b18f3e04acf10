"""model_exec/pooling_config.py: the pooling a model's files ask for, read without torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_exec.pooling_config import classifier_from_tokens, num_labels, pooling_max_len, resolve_pooler_config

_TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}


def _folder(tmp_path: Path, pooling: dict[str, object] | None, *extra: dict[str, str]) -> str:
    modules = [_TRANSFORMER]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules.extend(extra)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return str(tmp_path)


def test_architecture_defaults_without_modules_json(tmp_path: Path) -> None:
    decoder = resolve_pooler_config(str(tmp_path), "Qwen3ForCausalLM", {})
    assert (decoder.task, decoder.pooling_type, decoder.normalize) == ("embed", "LAST", False)
    bert = resolve_pooler_config(str(tmp_path), "BertModel", {})
    assert bert.pooling_type == "CLS"


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        ({"pooling_mode": "mean"}, "MEAN"),
        ({"pooling_mode": ["lasttoken"]}, "LAST"),
        ({"word_embedding_dimension": 8, "pooling_mode_cls_token": True}, "CLS"),  # sentence-transformers < 6
        ({"word_embedding_dimension": 8}, "MEAN"),  # legacy config with no mode set: its default
    ],
)
def test_sentence_transformers_pooling_modes(tmp_path: Path, pooling: dict[str, object], expected: str) -> None:
    normalize = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    config = resolve_pooler_config(_folder(tmp_path, pooling, normalize), "BertModel", {})
    assert (config.pooling_type, config.normalize) == (expected, True)


@pytest.mark.parametrize(
    ("pooling", "extra", "message"),
    [
        ({"pooling_mode": "max"}, [], "pooling mode 'max' is not supported"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, [], "is not supported"),
        ({"pooling_mode": "mean", "include_prompt": False}, [], "include_prompt=false"),
        ({"pooling_mode": "mean"}, [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}], "Dense"),
        (None, [], "names no Pooling module"),
    ],
)
def test_what_raytp_cannot_apply_is_refused(
    tmp_path: Path, pooling: dict[str, object] | None, extra: list[dict[str, str]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_pooler_config(_folder(tmp_path, pooling, *extra), "BertModel", {})


def test_pooler_config_override_and_cross_encoder_activation(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"pooling_mode": "cls"})
    over = resolve_pooler_config(folder, "BertModel", {}, {"pooling_type": "mean", "normalize": True})
    assert (over.pooling_type, over.normalize) == ("MEAN", True)
    with pytest.raises(ValueError, match="unsupported field"):
        resolve_pooler_config(folder, "BertModel", {}, {"dimensions": 3})
    one_label = resolve_pooler_config(str(tmp_path), "BertForSequenceClassification", {"num_labels": 1})
    assert (one_label.task, one_label.pooling_type, one_label.activation) == ("score", "CLS", "sigmoid")
    named = {"id2label": {"0": "a"}, "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}
    assert resolve_pooler_config(str(tmp_path), "BertForSequenceClassification", named).activation == "identity"


def test_xlm_roberta_length_leaves_room_for_its_position_offset() -> None:
    assert pooling_max_len("XLMRobertaModel", {"pad_token_id": 1}, 514) == 512
    assert pooling_max_len("BertModel", {}, 512) == 512


def test_decoder_classifier_heads_from_tokens(tmp_path: Path) -> None:
    """vLLM's hf_overrides for a decoder reranker: the last token, one sigmoid label for a 2-way softmax, one
    label per token without post-processing; a stored head's labels as HF counts them."""
    arch = "Qwen3ForSequenceClassification"
    qwen3 = {"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    config = resolve_pooler_config(str(tmp_path), arch, qwen3)
    assert (config.task, config.pooling_type, config.activation) == ("score", "LAST", "sigmoid")
    assert num_labels(qwen3) == 1 and classifier_from_tokens(qwen3) == (["no", "yes"], "from_2_way_softmax")
    plain = {"classifier_from_token": ["Yes", "No", "Maybe"], "method": "no_post_processing"}
    assert num_labels(plain) == 3 and resolve_pooler_config(str(tmp_path), arch, plain).activation == "identity"
    assert classifier_from_tokens({"num_labels": 1}) is None and num_labels({"num_labels": 1}) == 1
    for bad, message in [
        ({"classifier_from_token": "yes", "method": "no_post_processing"}, "list of token strings"),
        ({"classifier_from_token": ["yes"], "method": "softmax"}, "needs method"),
        ({"classifier_from_token": ["yes"], "is_original_qwen3_reranker": True}, "takes two tokens"),
    ]:
        with pytest.raises(ValueError, match=message):
            num_labels(bad)
