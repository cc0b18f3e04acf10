"""Mixtral: Llama's attention and layer, with a sparse mixture-of-experts MLP in every layer.

Routing (HF MixtralTopKRouter): softmax over all experts, top `num_experts_per_tok`, renormalised to sum
to one. Checkpoints name the MoE `block_sparse_moe` (experts' w1 = gate, w3 = up, w2 = down); transformers
5 calls it `mlp` in memory. Both load (`ExpertCheckpointLoader`).
"""

from __future__ import annotations

from torch import nn

from model_exec.config import ModelConfig, hf_int
from model_exec.layers.moe import SparseMoeBlock
from model_exec.layers.rotary import RotaryEmbedding
from model_exec.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from model_exec.models.loading import ExpertCheckpointLoader, ShardId
from model_exec.parallel import TPGroup
from ops.attention.base import AttentionBackend


class MixtralForCausalLM(ExpertCheckpointLoader, LlamaForCausalLM):
    def make_layer(
        self,
        config: ModelConfig,
        tp: TPGroup,
        attn_backend: type[AttentionBackend],
        rotary: RotaryEmbedding,
        layer: int,
    ) -> nn.Module:
        moe = SparseMoeBlock(
            num_experts=hf_int(config.hf, "num_local_experts", "num_experts"),
            top_k=hf_int(config.hf, "num_experts_per_tok"),
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            tp=tp,
            params_dtype=config.torch_dtype,
        )
        return LlamaDecoderLayer(config, tp, attn_backend, rotary, layer, mlp=moe)

    def checkpoint_param(self, ckpt_name: str) -> tuple[str, ShardId] | None:
        return super().checkpoint_param(ckpt_name.replace(".block_sparse_moe.", ".mlp."))
