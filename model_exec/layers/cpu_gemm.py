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

For one or two rows (single-stream decode, a server with one or two requests running) a linear layer
only streams its weight, and oneDNN streams it at ~12-14 GB/s per core here. With
`EngineConfig.cpu_panel_gemm` (off by default) such steps use a second copy of the weight in 16-wide
panels (`pack_panels`, `ops/csrc/panel_gemm.cpp`), which the C++ loop reads as one sequential
stream. Measured on one core (the other one busy), the 121 SmolLM2 matrices (layers and LM head),
one pass, median of 5: 1 row oneDNN 38 ms vs panels 20 ms, 2 rows 46 vs 23 ms, 3 rows 34 vs 49 ms:
hence `PANEL_MAX_ROWS = 2`. Reproduce with `python -m benchmarks.gemm_bench --tokens 1 2 3 --threads
1 --skip-dense`. The cost is memory: one more copy of every weight matrix (538 MB for SmolLM2-135M;
per TP rank, its shard). It is off by default because it gives up the batch independence above: a
row's last bits then depend on whether its step had 1-2 rows or more, and raytp's batch jobs promise
that a re-run (other batching) and the HTTP server give the same bytes
(tests/batch/test_http_parity.py, test_run.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.attention import cpu_kernels

PANEL = 16  # output features per panel (ops/csrc/panel_gemm.cpp's kPanel)
PANEL_MAX_ROWS = 2  # batches up to this many rows use the panels, larger ones oneDNN (measured, above)


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


def can_use_panels(weight: torch.Tensor) -> bool:
    """True when `weight` is an fp32 CPU matrix and the panel kernel is loaded with its AVX2 path."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and cpu_kernels.load_error() is None
        and cpu_kernels.vectorized()
    )


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` -> `[ceil(out / 16), in, 16]`: 16 output features side by side per input feature,
    the last panel zero-padded (a copy)."""
    out_features, in_features = weight.shape
    groups = -(-out_features // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, groups * PANEL - out_features))
    return padded.view(groups, PANEL, in_features).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias for x [M, in] (M small) with W packed by `pack_panels`."""
    y = torch.ops.raytp_cpu.panel_linear(x if x.stride(-1) == 1 else x.contiguous(), panels, out_features)
    return y if bias is None else y.add_(bias)
