"""Qwen2-MoE and Qwen3-MoE: Llama's layer with a sparse mixture-of-experts MLP in the layers that have one.

Shared by both (HF Qwen2Moe/Qwen3MoeSparseMoeBlock, TopKRouter): softmax over all experts, top
`num_experts_per_tok`, renormalised only with `norm_topk_prob`; experts of `moe_intermediate_size`; layer
i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`, and
then has a dense MLP of `intermediate_size`.

Qwen2-MoE adds q/k/v biases (ModelConfig.qkv_bias) and a shared expert that sees every token, scaled by
sigmoid(shared_expert_gate(x)); its partial sum joins the routed experts' before the one all-reduce.
Qwen3-MoE adds per-head RMSNorm on q and k before the rotation (Qwen3's attention, models/qwen3.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model_exec.config import ModelConfig, hf_int
from model_exec.layers.linear import GateUpParallelLinear, ReplicatedLinear, RowParallelLinear
from model_exec.layers.moe import SparseMoeBlock
from model_exec.layers.rotary import RotaryEmbedding
from model_exec.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from model_exec.models.loading import ExpertCheckpointLoader
from model_exec.models.qwen3 import Qwen3Attention
from model_exec.parallel import TPGroup
from ops.attention.base import AttentionBackend


class SharedExpert(nn.Module):
    """A gated MLP every token goes through; returns this rank's partial sum (the caller all-reduces)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(hidden_size, intermediate_size, False, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp, dtype, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE's MLP: routed experts + sigmoid(shared_expert_gate(x)) * shared_expert(x), one all-reduce
    (the gate is replicated, so scaling each rank's partial sum scales the total)."""

    def __init__(self, config: ModelConfig, tp: TPGroup, renormalize: bool) -> None:
        num_experts, top_k, inter = _experts_shape(config)
        dtype = config.torch_dtype
        super().__init__(num_experts, top_k, config.hidden_size, inter, renormalize, tp, dtype, reduce_results=False)
        shared = hf_int(config.hf, "shared_expert_intermediate_size")
        self.shared_expert = SharedExpert(config.hidden_size, shared, tp, dtype)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, False, tp, dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


def _experts_shape(config: ModelConfig) -> tuple[int, int, int]:
    """(num_experts, top_k, moe_intermediate_size) from config.json."""
    return (
        hf_int(config.hf, "num_experts", "num_local_experts"),
        hf_int(config.hf, "num_experts_per_tok"),
        hf_int(config.hf, "moe_intermediate_size"),
    )


def _is_sparse(config: ModelConfig, layer: int) -> bool:
    step = config.hf.get("decoder_sparse_step", 1)
    only_dense: Sequence[int] = config.hf.get("mlp_only_layers") or ()
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json: decoder_sparse_step must be a positive integer, got {step!r}")
    return layer not in only_dense and (layer + 1) % step == 0


def _norm_topk_prob(config: ModelConfig) -> bool:
    value = config.hf.get("norm_topk_prob", False)
    if not isinstance(value, bool):
        raise ValueError(f"config.json: norm_topk_prob must be true or false, got {value!r}")
    return value


class Qwen2MoeForCausalLM(ExpertCheckpointLoader, LlamaForCausalLM):
    def make_layer(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        rotary: RotaryEmbedding,
        layer: int,
    ) -> nn.Module:
        mlp = SharedExpertMoeBlock(config, tp, _norm_topk_prob(config)) if _is_sparse(config, layer) else None
        return LlamaDecoderLayer(config, tp, attn_backend, rotary, layer, mlp=mlp)


class Qwen3MoeForCausalLM(ExpertCheckpointLoader, LlamaForCausalLM):
    def make_layer(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        rotary: RotaryEmbedding,
        layer: int,
    ) -> nn.Module:
        mlp: nn.Module
        if _is_sparse(config, layer):
            num_experts, top_k, inter = _experts_shape(config)
            mlp = SparseMoeBlock(
                num_experts, top_k, config.hidden_size, inter, _norm_topk_prob(config), tp, config.torch_dtype
            )
        else:
            mlp = LlamaMLP(config, tp)
        attn = Qwen3Attention(config, tp, attn_backend, rotary, layer)
        return LlamaDecoderLayer(config, tp, attn_backend, rotary, layer, self_attn=attn, mlp=mlp)
