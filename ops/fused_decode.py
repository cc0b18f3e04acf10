"""One C++ call per decoder layer for a decode step on the CPU (`csrc/decode_layer.cpp`).

The op runs a Llama-shaped layer's whole decode step (norms, the q|k|v product, rotary, the KV-cache write,
paged decode attention, the o product, gate|up + SiLU, the down product) by calling the library's own kernels
through the c10 dispatcher, so it computes the unfused path's exact bits without its Python. Which layers
qualify and how their weights are described is `model_exec/models/fused_decode.py`'s; this module is the op's
typed front door.
"""

from __future__ import annotations

import torch

from ops.attention import cpu_kernels

# How a linear layer's weight is held (decode_layer.cpp's kKind*).
KIND_GGUF = 0  # GGUF blocks (and int8's Q8_0 blocks): `gguf_linear` per run of one GGML type
KIND_PANELS = 1  # fp32 16-wide panels (model_exec/layers/cpu_gemm.py): `panel_linear`
KIND_GGUF_PACKED = 2  # as KIND_GGUF, each run's blocks then their decode copy (`gguf.decode_pack`; empty: none)


def available() -> bool:
    """True when the kernel library (with the op) is built and loaded."""
    return cpu_kernels.load_error() is None


def decode_layer(
    hidden: torch.Tensor,  # [T, hidden] fp32: the previous layer's output (overwritten when residual is given)
    residual: torch.Tensor | None,  # [T, hidden] the un-normalised stream (updated in place); None at layer 0
    weights: list[torch.Tensor],  # the plan's tensors: norms, then each linear's weights and bias
    plan: list[int],  # heads, head_dim, rotary_dim, window, fused SiLU, then each linear's description
    eps: float,
    scale: float,
    soft_cap: float,  # 0: none
    cos: torch.Tensor,  # [T, 1, rotary_dim / 2], the step's RopeAngles
    sin: torch.Tensor,
    key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim], written at slot_mapping
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [>= T, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= T] int32
    gguf_road: int = 0,  # the GGUF products' road (model_exec/layers/quantization/row_roads.py; 0: by row count)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's MLP output, the residual stream), as `DecoderLayer.forward` returns them, for a step
    whose T rows are all decode rows."""
    out, res = torch.ops.raytp_cpu.decode_layer(
        hidden,
        residual,
        weights,
        plan,
        eps,
        scale,
        soft_cap,
        cos,
        sin,
        key_cache,
        value_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        gguf_road,
    )
    return out, res
