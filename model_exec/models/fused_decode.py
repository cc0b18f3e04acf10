"""The CPU road's one-call decoder layer for decode steps (`ops/fused_decode.py`, `ops/csrc/decode_layer.cpp`).

A single stream's decode step on the CPU spent ~31% of its time in Python and torch dispatch around each
layer's ~12 small ops (issue 39's profile of the Q4_1 default model). For a step whose rows are all decode
rows, `DecoderModel.forward` calls one C++ op per layer instead, which runs the same kernels in the same
order (so the same bits) from C++. This module turns a built, loaded and packed layer into that op's
arguments once (`layer_plan`), or says why it cannot.

What the op covers (the rest keeps the Python path, by an explicit check here or in `DecoderLayer.
fused_decode_plan`): Llama's layer shape (pre-norm, fused q|k|v and gate|up, SiLU-gated MLP) with any
RMSNorm weight vector (Gemma's 1 + w included), qkv/o/MLP biases, partial rotary, GQA, sliding windows and
attention soft-caps, at tensor parallelism 1, on the `cpu` attention backend in float32; weights held as
GGUF blocks (every kernel type, mixed-type layers too; Q4_0 / Q4_1 / Q8_0 with their decode copies), int8's
Q8_0 blocks (and copies), or fp32 panels. Not covered:
LoRA (its products are added by the layers' Python forward), MoE and non-SiLU MLPs, q/k norms, sandwich
norms, TP > 1 (the all-reduce), oneDNN-packed or dense weights (`cpu_panel_gemm=False`, an unpacked model),
fp8, and any step with a prefill row. `RAYTP_CPU_DECODE_LAYER=0` turns it off (A/B timing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from model_exec.layers import cpu_gemm
from model_exec.layers.linear import LinearBase
from model_exec.layers.norm import RMSNorm
from model_exec.layers.quantization.base import UnquantizedLinearMethod
from model_exec.layers.quantization.gguf import GGUFLinearMethod
from model_exec.layers.quantization.gguf_tensor import Q8_0
from model_exec.layers.quantization.int8 import Int8LinearMethod
from ops import fused_decode
from ops.attention.base import AttentionBackend
from ops.attention.cpu_backend import CpuAttentionBackend


class Pending(Exception):
    """A layer's weights are not in their final layout yet (loaded but not packed): decide later."""


@dataclass(frozen=True)
class LayerPlan:
    """One layer's fixed arguments of `ops.fused_decode.decode_layer`."""

    weights: list[torch.Tensor]
    plan: list[int]
    eps: float
    scale: float
    soft_cap: float


def wanted() -> bool:
    """False when RAYTP_CPU_DECODE_LAYER=0 (read when a model is built: one process can hold both kinds)."""
    return os.environ.get("RAYTP_CPU_DECODE_LAYER", "1") != "0"


def linear_plan(layer: LinearBase) -> tuple[list[int], list[torch.Tensor]] | None:
    """(plan ints, tensors) of one linear layer as its quantization method multiplies it; None when the op
    cannot run it; `Pending` when its weights are not packed yet."""
    if layer.lora is not None:
        return None
    method = layer.quant_method
    out_features = layer.weight.shape[0]
    bias = [layer.bias] if layer.bias is not None else []
    head = [out_features, len(bias)]
    if isinstance(method, GGUFLinearMethod) and method.dense is None:
        if not method.segments:
            raise Pending
        qtypes = [qtype for qtype, _ in method.segments]
        raws = [raw for _, raw in method.segments]
        if any(p is not None for p in method.packed):  # each run's blocks, then its decode copy (or an empty one)
            none = torch.empty(0, dtype=torch.uint8)
            copies = [p if p is not None else none for p in method.packed]
            pairs = [t for raw, packed in zip(raws, copies, strict=True) for t in (raw, packed)]
            return [fused_decode.KIND_GGUF_PACKED, len(raws), *head, *qtypes], pairs + bias
        return [fused_decode.KIND_GGUF, len(raws), *head, *qtypes], raws + bias
    if isinstance(method, Int8LinearMethod) and method.blocks is not None:
        if method.packed is not None:
            return [fused_decode.KIND_GGUF_PACKED, 1, *head, Q8_0], [method.blocks, method.packed, *bias]
        return [fused_decode.KIND_GGUF, 1, *head, Q8_0], [method.blocks, *bias]
    if not isinstance(method, UnquantizedLinearMethod | GGUFLinearMethod):
        return None  # fp8 and any other method: its own product
    if layer.panel_weight is not None:
        return [fused_decode.KIND_PANELS, 1, *head], [layer.panel_weight, *bias]
    if layer.packed_weight is not None:
        return None  # oneDNN's layout: only its own op reads it
    raise Pending


def layer_plan(
    input_norm: RMSNorm,
    post_norm: RMSNorm,
    qkv_proj: LinearBase,
    o_proj: LinearBase,
    gate_up: LinearBase,
    down: LinearBase,
    attn: AttentionBackend,
    rotary_dim: int,
) -> LayerPlan | None:
    """The op's arguments for a layer of Llama's shape (the caller checked the shape); None when a part
    cannot run in it, `Pending` when weights are not packed yet."""
    if type(attn) is not CpuAttentionBackend or qkv_proj.tp.world_size != 1 or not fused_decode.available():
        return None
    norms = (input_norm.kernel_weight(), post_norm.kernel_weight())
    if any(w.dtype != torch.float32 or not w.is_cpu or not w.is_contiguous() for w in norms):
        return None
    if input_norm.eps != post_norm.eps:
        return None
    parts = [linear_plan(layer) for layer in (qkv_proj, o_proj, gate_up, down)]
    if any(p is None for p in parts):
        return None
    half = gate_up.weight.shape[0] // 2
    # the panel kernel's gate|up + SiLU in one pass, where `GateUpParallelLinear.silu_and_mul` takes it
    fused_silu = gate_up.panel_weight is not None and gate_up.bias is None and half % cpu_gemm.PANEL == 0
    ints = [attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary_dim, attn.sliding_window or 0, int(fused_silu)]
    weights = list(norms)
    for p in parts:
        assert p is not None
        ints += p[0]
        weights += p[1]
    return LayerPlan(weights, ints, float(input_norm.eps), float(attn.scale), float(attn.logits_soft_cap or 0.0))
