"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2), tensor-parallel.

Differences between the family members are config fields, not subclasses:
qkv_bias (Qwen2), o_bias (Llama `attention_bias`), tied embeddings (SmolLM2),
rope scaling and partial rotary (Llama 3.x, any family), per-layer sliding windows (Mistral, Qwen2).
Every layer is built at its per-rank shard shape.

Families that differ in structure subclass these classes (models/qwen3.py, models/phi3.py): each class
names the one it builds below it (`attention_cls`, `layer_cls`, `model_cls`), and `LlamaAttention`
offers one hook, `normalise_qk`, between the projection and the rotation.
A family whose layers differ only in their MLP or attention module may instead override
`make_layer` and hand the layer its modules (mixtral.py, qwen_moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from model_exec.config import ModelConfig
from model_exec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_exec.layers.linear import GateUpParallelLinear, QKVParallelLinear, RowParallelLinear
from model_exec.layers.norm import RMSNorm
from model_exec.layers.rotary import RopeAngles, RotaryEmbedding
from model_exec.models.loading import STACKED_QKV_GATE_UP, STACKED_QKV_GATE_UP_SHARD_IDS, CheckpointLoader, ShardId
from model_exec.parallel import TPGroup
from ops.attention.base import AttentionBackend, AttentionMetadata


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        rotary: RotaryEmbedding,
        layer: int,
    ) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
            tp=tp,
            params_dtype=dtype,
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, config.o_bias, tp, dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary_emb = rotary  # one instance shared by all layers (its cache is not in state_dict)
        self.attn = attn_backend(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            config.head_dim**-0.5,
            sliding_window=config.layer_window(layer),
        )

    def normalise_qk(self, qkv: torch.Tensor) -> None:
        """Between projection and rotation: a family may rewrite the q and k parts of qkv [T, q | k | v]
        in place (Qwen3's per-head RMSNorm). Llama does nothing."""

    def forward(
        self,
        rope: RopeAngles,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        self.normalise_qk(qkv)
        qk_size = self.qkv_proj.q_size + self.qkv_proj.kv_size
        num_tokens = hidden.shape[0]
        # q and k sit side by side in the fused output: one rotation covers both (strided views, no copy
        # in). qkv is this call's own tensor, so the rotation may overwrite it in place; either way q and
        # k reach the backend as [T, heads, head_dim] views with a contiguous last dim and strided rows.
        qk = self.rotary_emb.rotate_owned(
            rope, qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{config.architecture}: hidden_act {config.hidden_act!r} is not implemented (silu only)")
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = GateUpParallelLinear(hidden, inter, bias, tp, config.torch_dtype)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp, config.torch_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        rotary: RotaryEmbedding,
        layer: int,
        self_attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        """`self_attn` and `mlp` replace Llama's own (a family whose layers differ only there, e.g. MoE):
        modules with LlamaAttention's forward(rope, hidden, kv_cache, meta) and LlamaMLP's forward(x)."""
        super().__init__()
        self.self_attn = (
            self_attn if self_attn is not None else self.attention_cls(config, tp, attn_backend, rotary, layer)
        )
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)

    def forward(
        self,
        rope: RopeAngles,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # `residual` is the un-normalised stream; each norm adds the previous block's output into it.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# builds decoder layer `layer`: (config, tp, attn_backend, rotary, layer) -> module with LlamaDecoderLayer's forward
LayerFactory = Callable[[ModelConfig, TPGroup, type[AttentionBackend], RotaryEmbedding, int], nn.Module]


class LlamaModel(nn.Module):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        make_layer: LayerFactory | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, config.torch_dtype)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            rotary_dim=config.rotary_dim,
        )
        self.layers = nn.ModuleList(
            (make_layer or self.layer_cls)(config, tp, attn_backend, self.rotary_emb, i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} (key, value) cache pairs, got {len(kv_caches)}")
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.angles(positions, hidden.dtype, meta)  # once per step, not per layer
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CheckpointLoader):
    model_cls: ClassVar[type[LlamaModel]] = LlamaModel
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = STACKED_QKV_GATE_UP
    packed_shard_ids: ClassVar[dict[str, tuple[ShardId, ...]]] = STACKED_QKV_GATE_UP_SHARD_IDS

    def __init__(self, config: ModelConfig, tp: TPGroup, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        config.check_tp(tp.world_size)
        self.config = config
        self.tp = tp
        self.model = self.model_cls(config, tp, attn_backend, self.make_layer)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, config.torch_dtype, tied)

    def make_layer(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        rotary: RotaryEmbedding,
        layer: int,
    ) -> nn.Module:
        """Decoder layer `layer` (the model class's `layer_cls`); a family whose layers differ only in their
        modules overrides this."""
        return self.model_cls.layer_cls(config, tp, attn_backend, rotary, layer)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] packed tokens of all rows
        positions: torch.Tensor,  # [T] int64 position of each token in its sequence
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key_cache, value_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> full-vocabulary logits [N, vocab] on rank 0, None on other ranks."""
        return self.lm_head.compute_logits(hidden)
