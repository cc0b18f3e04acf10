"""Gemma 2 decoder (Gemma2ForCausalLM), tensor-parallel; Gemma 3's text model (gemma3.py) extends it.

What Gemma does differently from Llama, each as HF's Gemma2 code does it:
- the embedding output is multiplied by sqrt(hidden_size), that factor first rounded to the model dtype;
- RMSNorm multiplies by (1 + weight) in float32 (`GemmaRMSNorm`), and every block is sandwiched: a norm
  before and after attention, and before and after the MLP, the residual added after the second;
- gelu_pytorch_tanh gated MLP; attention scale query_pre_attn_scalar**-0.5;
- attention scores soft-capped (`attn_logit_softcapping`) and the LM head's logits too
  (`final_logit_softcapping`, applied on rank 0's gathered full-vocabulary logits);
- local sliding-window layers alternating with global ones (`ModelConfig.layer_windows`); tied embeddings.

The per-family fields come from `ModelConfig.hf` (config.json with HF's defaults under it, see
model_exec/architectures.py) and are checked here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from model_exec.config import ModelConfig
from model_exec.layers.activation import act_and_mul
from model_exec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_exec.layers.linear import GateUpParallelLinear, QKVParallelLinear, RowParallelLinear
from model_exec.layers.norm import GemmaRMSNorm
from model_exec.layers.rotary import RopeAngles, RotaryEmbedding
from model_exec.models.loading import STACKED_QKV_GATE_UP, STACKED_QKV_GATE_UP_SHARD_IDS, CheckpointLoader, ShardId
from model_exec.parallel import TPGroup
from ops.attention.base import AttentionBackend, AttentionMetadata


def _optional_positive(hf: Mapping[str, Any], name: str) -> float | None:
    value = hf.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"config.json: {name} must be a positive number or null, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class GemmaOptions:
    """The Gemma fields of config.json that `ModelConfig` does not carry."""

    attn_scale: float  # query_pre_attn_scalar ** -0.5
    attn_soft_cap: float | None
    final_soft_cap: float | None

    @classmethod
    def parse(cls, config: ModelConfig) -> GemmaOptions:
        hf = config.hf
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{config.architecture}: use_bidirectional_attention (embedding models) is not supported")
        scalar = _optional_positive(hf, "query_pre_attn_scalar")
        if scalar is None:
            raise ValueError("config.json: query_pre_attn_scalar is required for Gemma models")
        return cls(
            attn_scale=scalar**-0.5,
            attn_soft_cap=_optional_positive(hf, "attn_logit_softcapping"),
            final_soft_cap=_optional_positive(hf, "final_logit_softcapping"),
        )


class Gemma2Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        options: GemmaOptions,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
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
        self.attn = attn_backend(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            options.attn_scale,
            sliding_window=config.layer_window(layer),
            logits_soft_cap=options.attn_soft_cap,
        )

    def rotated_qk(self, rope: RopeAngles, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k [T, kv_heads, head_dim] of the fused projection, rotated.

        q and k sit side by side in `qkv` (this call's own tensor): one in-place rotation covers both."""
        num_tokens = qkv.shape[0]
        qk_size = self.qkv_proj.q_size + self.qkv_proj.kv_size
        qk = RotaryEmbedding.rotate_owned(
            rope, qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k

    def forward(
        self,
        rope: RopeAngles,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        num_tokens = hidden.shape[0]
        q, k = self.rotated_qk(rope, qkv)
        v = qkv[:, self.qkv_proj.q_size + self.qkv_proj.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = GateUpParallelLinear(hidden, inter, bias, tp, config.torch_dtype)
        self.act = act_and_mul(config.hidden_act)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp, config.torch_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    attention_class: ClassVar[type[Gemma2Attention]] = Gemma2Attention

    def __init__(
        self,
        config: ModelConfig,
        options: GemmaOptions,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        layer: int,
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, options, tp, attn_backend, layer)
        self.mlp = GemmaMLP(config, tp)
        size, eps, dtype = config.hidden_size, config.rms_norm_eps, config.torch_dtype
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self,
        rope: RopeAngles,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # `residual` is the stream; `hidden` the previous block's post-normed output, not yet added to it
        # (HF adds it right after the post-norm: the same sum, one fused add+norm later).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(nn.Module):
    layer_class: ClassVar[type[Gemma2DecoderLayer]] = Gemma2DecoderLayer

    def __init__(
        self, config: ModelConfig, options: GemmaOptions, tp: TPGroup, attn_backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        # HF: torch.tensor(sqrt(hidden)).to(weight dtype), so in bfloat16 sqrt(3072) = 55.43 becomes 55.5
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5).to(dtype), persistent=False)
        rotaries, self.layer_rotary = self.rotary_embeddings(config)
        self.rotary_embs = nn.ModuleList(rotaries)
        self.layers = nn.ModuleList(
            self.layer_class(config, options, tp, attn_backend, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    @staticmethod
    def rotary_embeddings(config: ModelConfig) -> tuple[list[RotaryEmbedding], list[int]]:
        """The model's rotary embeddings and, per layer, the index of the one it uses (Gemma 2: one)."""
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        return [rotary], [0] * config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} (key, value) cache pairs, got {len(kv_caches)}")
        hidden = self.embed_tokens(input_ids).mul_(self.embed_scale)
        rotaries: list[RotaryEmbedding] = list(self.rotary_embs)  # type: ignore[arg-type]  # ModuleList of them
        ropes = [r.angles(positions, hidden.dtype, meta) for r in rotaries]  # once per step, not per layer
        residual: torch.Tensor | None = None
        for layer, rotary, kv_cache in zip(self.layers, self.layer_rotary, kv_caches, strict=True):
            hidden, residual = layer(ropes[rotary], hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(CheckpointLoader):
    model_class: ClassVar[type[Gemma2Model]] = Gemma2Model
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = STACKED_QKV_GATE_UP
    packed_shard_ids: ClassVar[dict[str, tuple[ShardId, ...]]] = STACKED_QKV_GATE_UP_SHARD_IDS

    def __init__(self, config: ModelConfig, tp: TPGroup, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        config.check_tp(tp.world_size)
        self.config = config
        self.tp = tp
        self.options = self.parse_options(config)
        self.model = self.model_class(config, self.options, tp, attn_backend)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, config.torch_dtype, tied)

    @staticmethod
    def parse_options(config: ModelConfig) -> GemmaOptions:
        return GemmaOptions.parse(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] packed tokens of all rows
        positions: torch.Tensor,  # [T] int64 position of each token in its sequence
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key_cache, value_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> full-vocabulary logits [N, vocab] on rank 0 (soft-capped there), None elsewhere."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.options.final_soft_cap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # HF's order of operations
