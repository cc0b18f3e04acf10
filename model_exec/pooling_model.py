"""A rank's pooling model and head (runner="pooling"): which class runs, and the head its files ask for.

Pooling-only architectures (encoders, cross-encoders) build their registered class; a generation
architecture runs as an embedder (models/decoder_embedder.py: the same decoder, no LM head).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from model_exec.architectures import ARCHITECTURES
from model_exec.config import ModelConfig
from model_exec.models import CausalLM, get_model_class
from model_exec.parallel import TPGroup
from model_exec.pooler import Pooler, ScoreHead
from model_exec.pooling_config import resolve_pooler_config
from model_exec.source import ModelSource, load_tokenizer
from ops.attention.base import AttentionBackend


def pooling_model_class(architecture: str) -> type[nn.Module]:
    if ARCHITECTURES[architecture].task == "generate":
        from model_exec.models.decoder_embedder import embedder_class

        return embedder_class(architecture)
    return get_model_class(architecture)


def build_pooling_model(
    source: ModelSource,
    config: ModelConfig,
    tp: TPGroup,
    attn_backend: type[AttentionBackend],
    device: torch.device,
    dtype: torch.dtype,
    pooler_override: Mapping[str, Any] | None,
) -> tuple[CausalLM, Pooler]:
    """This rank's model shard (unloaded, as models.build_model) and the pooling head over it."""
    config = replace(config, dtype=str(dtype).removeprefix("torch."))
    cls = pooling_model_class(config.architecture)
    with torch.device(device):
        model = cls(config, tp, attn_backend)
    model.eval()
    if hasattr(model, "sep_token_id"):  # BERT pairs: token types from the tokenizer's [SEP] (models/bert.py)
        model.sep_token_id = load_tokenizer(source).sep_token_id
    if hasattr(model, "classifier_token_ids"):  # a decoder reranker's head from LM head rows (decoder_classifier)
        from model_exec.models.decoder_classifier import classifier_token_ids

        model.classifier_token_ids = classifier_token_ids(config.hf, load_tokenizer(source))  # type: ignore[assignment]
    pooler_config = resolve_pooler_config(source.metadata_dir, config.architecture, config.hf, pooler_override)
    head: ScoreHead | None = model if pooler_config.task == "score" else None  # type: ignore[assignment]
    return model, Pooler(pooler_config, head)  # type: ignore[return-value]  # nn.Module satisfies CausalLM
