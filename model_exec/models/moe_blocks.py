"""The MoE families' MLPs: each a factory a registry row's `DecoderSpec.mlp` names, building layer i's MLP
(None: that layer has the decoder's dense gated MLP of `intermediate_size`).

Mixtral (HF MixtralTopKRouter): every layer sparse; softmax over all experts, top `num_experts_per_tok`,
renormalised to sum to one. Checkpoints name the MoE `block_sparse_moe` (experts' w1 = gate, w3 = up,
w2 = down); transformers 5 calls it `mlp` in memory; both load (the row's rename, `ExpertCheckpointLoader`).

Qwen2-MoE and Qwen3-MoE (HF Qwen2Moe/Qwen3MoeSparseMoeBlock, TopKRouter): softmax over all experts, top
`num_experts_per_tok`, renormalised only with `norm_topk_prob`; experts of `moe_intermediate_size`; layer i
is sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`. Qwen2-MoE
adds a shared expert that sees every token, scaled by sigmoid(shared_expert_gate(x)); its partial sum joins
the routed experts' before the one all-reduce. (Their attention quirks, q/k/v biases and Qwen3's q/k norms,
are in their rows.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model_exec.config import ModelConfig, hf_int
from model_exec.layers.linear import ReplicatedLinear
from model_exec.layers.moe import FusedMoE, SparseMoeBlock
from model_exec.models.decoder import GatedMLP
from model_exec.parallel import TPGroup


def mixtral_moe(config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module:
    experts = FusedMoE(
        num_experts=hf_int(config.hf, "num_local_experts", "num_experts"),
        top_k=hf_int(config.hf, "num_experts_per_tok"),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        renormalize=True,
        tp=tp,
        params_dtype=config.torch_dtype,
    )
    return SparseMoeBlock(experts)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE's MLP: routed experts + sigmoid(shared_expert_gate(x)) * shared_expert(x), one all-reduce
    (the gate is replicated, so scaling each rank's partial sum scales the total)."""

    def __init__(self, config: ModelConfig, tp: TPGroup, renormalize: bool) -> None:
        num_experts, top_k, inter = _experts_shape(config)
        dtype = config.torch_dtype
        super().__init__(
            FusedMoE(num_experts, top_k, config.hidden_size, inter, renormalize, tp, dtype, reduce_results=False)
        )
        shared = hf_int(config.hf, "shared_expert_intermediate_size")
        self.shared_expert = GatedMLP(config.hidden_size, shared, "silu", False, tp, dtype, reduce_results=False)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, False, tp, dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


def qwen2_moe(config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module | None:
    return SharedExpertMoeBlock(config, tp, _norm_topk_prob(config)) if _is_sparse(config, layer) else None


def qwen3_moe(config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module | None:
    if not _is_sparse(config, layer):
        return None
    num_experts, top_k, inter = _experts_shape(config)
    return SparseMoeBlock(
        FusedMoE(num_experts, top_k, config.hidden_size, inter, _norm_topk_prob(config), tp, config.torch_dtype)
    )


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
