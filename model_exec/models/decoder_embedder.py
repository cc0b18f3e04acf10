"""Decoder families as embedders (runner="pooling"): the registered causal LM without its LM head.

Relies on one thing of the decoder classes: their forward (`CausalDecoder.forward`, inherited as it is)
returns the final hidden states (after the last norm) for the packed tokens, logits being a separate call,
so the pooler reads those states (last token by default). The attention stays the family's own, causal
and paged: a pooling step writes its prompt's keys into blocks the scheduler frees right after.

Checkpoints: a causal LM's own (`model.layers...`, `lm_head` skipped), and the base-model checkpoints that
embedding models ship (Qwen3-Embedding, gte-Qwen2, a sentence-transformers folder of a decoder: tensor
names without the `model.` prefix, no LM head), whose config names `Qwen3Model` and the like.
"""

from __future__ import annotations

import torch
from torch import nn

from model_exec.config import ModelConfig
from model_exec.models import get_model_class
from model_exec.models.loading import CheckpointLoader, ShardId
from model_exec.parallel import TPGroup
from ops.attention.base import AttentionBackend


class DecoderEmbedderMixin(CheckpointLoader):
    """Mixed in before a registered causal LM class: same layers, no LM head, base-model tensor names."""

    model: nn.Module
    config: ModelConfig

    def __init__(self, config: ModelConfig, tp: TPGroup, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config, tp, attn_backend)  # the causal LM's constructor (next in the MRO)
        del self.lm_head  # pooling never computes logits; a tied head would only alias the embedding

    def checkpoint_param(self, ckpt_name: str) -> tuple[str, ShardId] | None:
        if ckpt_name.startswith("lm_head."):
            return None
        if not ckpt_name.startswith("model."):
            ckpt_name = "model." + ckpt_name
        return super().checkpoint_param(ckpt_name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise ValueError(f"{self.config.architecture} runs as an embedder here: it has no language-model head")


def embedder_class(causal_architecture: str) -> type[nn.Module]:
    """The embedder over a registered causal LM architecture (model_exec/architectures.py)."""
    base = get_model_class(causal_architecture)
    return type(f"{base.__name__}Embedder", (DecoderEmbedderMixin, base), {})


# The registry's base-model rows (config.json `architectures`: ["Qwen3Model"], ...)
LlamaModel = embedder_class("LlamaForCausalLM")
Qwen2Model = embedder_class("Qwen2ForCausalLM")
Qwen3Model = embedder_class("Qwen3ForCausalLM")
