"""Decoder families as sequence classifiers (task "score": rerankers): the registered causal LM's decoder and a
classification head on the last prompt token's final hidden state, as HF's and vLLM's
`*ForSequenceClassification` (a bias-free `score` linear; the pooler picks the last token, model_exec/pooler.py).

The head comes from one of two places:
- a sequence-classification checkpoint's own `score.weight` [num_labels, hidden] (a converted reranker);
- a causal LM's head rows for the tokens vLLM's `hf_overrides` name (`classifier_from_token`,
  model_exec/pooling_config.py): `from_2_way_softmax` over [false, true] ("no", "yes" for the original
  Qwen3-Reranker, `is_original_qwen3_reranker: true`) makes one label W[true] - W[false], so the sigmoid the
  pooler applies to a one-label score equals softmax([logit_false, logit_true])[1] at the last token: the
  reranker's own "yes" probability. `no_post_processing` keeps each token's row as a label.
The rows are cut from the full checkpoint tensor while it streams by (the LM head's, or the embedding's when
they are tied), so no LM head is built; the difference is taken in float32.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from model_exec.config import ModelConfig
from model_exec.models import get_model_class
from model_exec.models.decoder_embedder import DecoderEmbedderMixin
from model_exec.models.loading import ShardId
from model_exec.parallel import TPGroup
from model_exec.pooling_config import classifier_from_tokens, num_labels
from ops.attention.base import AttentionBackend


class DecoderClassifierMixin(DecoderEmbedderMixin):
    """Mixed in before a registered causal LM class: its decoder (no LM head) and a replicated score head."""

    def __init__(self, config: ModelConfig, tp: TPGroup, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config, tp, attn_backend)
        self.score = nn.Linear(config.hidden_size, num_labels(config.hf), bias=False, dtype=config.torch_dtype)
        self.from_tokens = classifier_from_tokens(config.hf)
        # the ids of `classifier_from_token`, from the model's tokenizer (set by model_exec/pooling_model.py
        # before loading; the class has no tokenizer)
        self.classifier_token_ids: list[int] | None = None

    def checkpoint_param(self, ckpt_name: str) -> tuple[str, ShardId] | None:
        if ckpt_name == "score.weight":
            return ckpt_name, None
        return super().checkpoint_param(ckpt_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._with_head_from_tokens(weights) if self.from_tokens else weights)

    def _with_head_from_tokens(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.from_tokens is not None
        if self.classifier_token_ids is None:
            raise ValueError("classifier_from_token: the token ids were not resolved before loading")
        head_names = ("model.embed_tokens.weight", "embed_tokens.weight") if self.config.tie_word_embeddings else (
            "lm_head.weight",
        )  # fmt: skip
        made = False
        for name, tensor in weights:
            yield name, tensor
            if name in head_names and not made:
                rows = tensor[self.classifier_token_ids].float()
                head = rows[1:2] - rows[0:1] if self.from_tokens[1] == "from_2_way_softmax" else rows
                made = True
                yield "score.weight", head.to(tensor.dtype)

    def classify(self, last_token_hidden: torch.Tensor) -> torch.Tensor:
        return self.score(last_token_hidden)


def classifier_token_ids(hf: Mapping[str, Any], tokenizer: Any) -> list[int] | None:
    """The ids of `classifier_from_token` in the model's tokenizer (None without it); ValueError naming a token
    the tokenizer does not have as one token."""
    from_tokens = classifier_from_tokens(hf)
    if from_tokens is None:
        return None
    vocab = tokenizer.get_vocab()
    missing = [t for t in from_tokens[0] if t not in vocab]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} not a single token of this model's tokenizer")
    ids = [int(vocab[t]) for t in from_tokens[0]]
    if max(ids) >= int(hf["vocab_size"]):
        raise ValueError(f"classifier_from_token: ids {ids} are outside the model's vocabulary ({hf['vocab_size']})")
    return ids


def classifier_class(causal_architecture: str) -> type[nn.Module]:
    """The sequence classifier over a registered causal LM architecture (model_exec/architectures.py)."""
    base = get_model_class(causal_architecture)
    return type(f"{base.__name__}Classifier", (DecoderClassifierMixin, base), {})


# The registry's rows (config.json or hf_overrides `architectures`: ["Qwen3ForSequenceClassification"])
Qwen3ForSequenceClassification = classifier_class("Qwen3ForCausalLM")
