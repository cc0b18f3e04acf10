"""Qwen3 (Qwen3ForCausalLM): Llama with a per-head RMSNorm on q and k before the rotation.

Its other differences are shared config fields: head_dim independent of hidden_size / heads,
`attention_bias` (q, k, v and o), per-layer windows from `layer_types`. The norms act on one head's
head_dim features, so every TP rank applies the same replicated weights to its own heads.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from model_exec.config import ModelConfig
from model_exec.layers.norm import RMSNorm
from model_exec.layers.rotary import RotaryEmbedding
from model_exec.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from model_exec.parallel import TPGroup
from ops.attention.base import AttentionBackend


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        rotary: RotaryEmbedding,
        layer: int,
    ) -> None:
        super().__init__(config, tp, attn_backend, rotary, layer)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.torch_dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.torch_dtype)

    def normalise_qk(self, qkv: torch.Tensor) -> None:
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        # one row per head; reshape copies (the heads' rows are strided in qkv), the norms write a new tensor
        q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view_as(q))
        k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view_as(k))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls: ClassVar[type[LlamaModel]] = Qwen3Model
