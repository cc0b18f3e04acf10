"""Tensor-parallel building blocks of the models."""

from model_exec.layers.activation import GeluTanhAndMul, SiluAndMul
from model_exec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_exec.layers.linear import (
    ColumnParallelLinear,
    GateUpParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from model_exec.layers.norm import GemmaRMSNorm, RMSNorm
from model_exec.layers.rotary import RotaryEmbedding, compute_inv_freq

__all__ = [
    "ColumnParallelLinear",
    "GateUpParallelLinear",
    "GeluTanhAndMul",
    "GemmaRMSNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "compute_inv_freq",
]
