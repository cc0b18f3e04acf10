"""Gemma 3's text model (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2 (gemma2.py) plus

- a per-head RMSNorm (1 + weight, as every Gemma norm) on queries and keys, before the rotation;
- rope per layer type: the local sliding-window layers rotate with `rope_local_base_freq` (10k), the global
  ones with `rope_theta` (1M) and `rope_scaling` (linear on the larger models); transformers 5 writes both
  as `rope_parameters` = {"sliding_attention": {...}, "full_attention": {...}};
- no attention soft-capping: HF's Gemma3Attention never applies `attn_logit_softcapping`, so a config that
  sets it is refused rather than served differently from HF. The final logit soft-cap applies if set.

The multimodal Gemma3ForConditionalGeneration (vision tower, `language_model.` weight names) is not here.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from model_exec.config import ModelConfig, _normalise_rope, hf_layer_types
from model_exec.layers.norm import GemmaRMSNorm
from model_exec.layers.rotary import RopeAngles, RotaryEmbedding
from model_exec.models.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
    GemmaOptions,
)
from model_exec.parallel import TPGroup
from ops.attention.base import AttentionBackend

LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_by_layer_type(config: ModelConfig) -> dict[str, ModelConfig]:
    """`config` with each layer type's rope_theta and rope_scaling (checked as ModelConfig checks any)."""
    hf = config.hf
    params = hf.get("rope_parameters")
    if params is None:  # transformers-4 config.json: the global layers' scaling is `rope_scaling`
        by_type: dict[str, dict[str, Any]] = {
            "full_attention": {"rope_type": "default", **(hf.get("rope_scaling") or {})},
            "sliding_attention": {"rope_type": "default"},
        }
    elif isinstance(params, dict) and set(params) <= set(LAYER_TYPES):
        by_type = {t: dict(params.get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    else:
        raise ValueError(f"config.json: Gemma 3's rope_parameters must be keyed by {LAYER_TYPES}, got {params!r}")
    # HF's Gemma3TextConfig fills a missing theta from these fields (their defaults: architectures.py)
    by_type["full_attention"].setdefault("rope_theta", hf["rope_theta"])
    by_type["sliding_attention"].setdefault("rope_theta", hf["rope_local_base_freq"])
    out = {}
    for layer_type, p in by_type.items():
        theta, scaling, _ = _normalise_rope(SimpleNamespace(rope_parameters=p), config.max_position_embeddings)
        out[layer_type] = replace(config, rope_theta=theta, rope_scaling=scaling)
    return out


class Gemma3Attention(Gemma2Attention):
    def __init__(
        self,
        config: ModelConfig,
        options: GemmaOptions,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        layer: int,
    ) -> None:
        super().__init__(config, options, tp, attn_backend, layer)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, config.torch_dtype)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, config.torch_dtype)

    def rotated_qk(self, rope: RopeAngles, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head of q and k normalised (one row per head: reshape copies the strided slices into the
        rows the norm kernels take), then rotated in place (the norms' outputs are new tensors)."""
        num_tokens, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = self.q_norm(qkv[:, :q_size].reshape(-1, d)).view(num_tokens, self.num_heads, d)
        k = self.k_norm(qkv[:, q_size : q_size + kv_size].reshape(-1, d)).view(num_tokens, self.num_kv_heads, d)
        return RotaryEmbedding.rotate_owned(rope, q), RotaryEmbedding.rotate_owned(rope, k)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class: ClassVar[type[Gemma2Attention]] = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_class: ClassVar[type[Gemma2DecoderLayer]] = Gemma3DecoderLayer

    @staticmethod
    def rotary_embeddings(config: ModelConfig) -> tuple[list[RotaryEmbedding], list[int]]:
        """One rotary embedding per layer type; each layer uses its type's (as HF, whether or not the
        type's layers actually window)."""
        hf = config.hf
        types = hf_layer_types(hf.get("layer_types"), hf.get("sliding_window_pattern"), config.num_hidden_layers)
        types = types or ["full_attention"] * config.num_hidden_layers
        if len(types) != config.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(
                f"config.json: Gemma 3's layer_types must be one of {LAYER_TYPES} per layer, got {types!r}"
            )
        ropes = rope_by_layer_type(config)
        rotaries = [
            RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
            for c in (ropes[t] for t in LAYER_TYPES)
        ]
        return rotaries, [LAYER_TYPES.index(t) for t in types]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class: ClassVar[type[Gemma2Model]] = Gemma3Model

    @staticmethod
    def parse_options(config: ModelConfig) -> GemmaOptions:
        options = GemmaOptions.parse(config)
        if options.attn_soft_cap is not None:
            raise ValueError(
                "config.json: attn_logit_softcapping is set, but Hugging Face's Gemma 3 never applies it; "
                "refusing rather than computing something else than the reference"
            )
        return options
