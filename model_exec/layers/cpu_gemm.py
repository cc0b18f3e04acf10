"""Prepacked oneDNN weights for fp32 linear layers on the CPU.

`F.linear` on the CPU goes to MKL, which reads an `[out, in]` weight at ~10-12 GB/s on this
project's AMD machines (MKL picks generic code paths on non-Intel CPUs). oneDNN, with the weight
reordered once into its blocked layout, runs the same products much faster. Measured on 2 cores,
SmolLM2-135M's 120 layer matrices (`python -m benchmarks.gemm_bench`): one token 37 -> 21 ms,
64 tokens 108 -> 73 ms, 512 tokens ~1.2x; the 49152 x 576 LM head at 64 rows 56 -> 29 ms.

The packing hint (batch size) is left unset: measured, it is the best single layout for every
batch size from 1 to 2048 tokens. Each output row depends on its own input row only (oneDNN does
not split the reduction across rows), so results do not depend on the batch.

The packed tensor is an opaque `torch._mkldnn` tensor: it can only be passed to
`packed_linear`; the layer keeps what it needs (shape) on the side.
"""

from __future__ import annotations

import torch


def can_pack(weight: torch.Tensor) -> bool:
    """True when `weight` is an fp32 CPU matrix and this torch build has oneDNN's linear ops."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` fp32 weight -> oneDNN's blocked layout (a copy; the caller may free the original)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias with W prepacked by `pack_weight`; x is [..., in]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
