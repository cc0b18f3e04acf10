"""GGUF weights kept in their block layout on the CPU (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K): `ops/csrc/gguf_gemm.cpp`
(and `gguf_kquants.cpp` for the K-quants) multiplies with them directly, so a decode step reads the file's
bytes per weight (0.625 for Q4_1, 0.5625 for Q4_K, 0.82 for Q6_K) instead of fp32's 4.

A layer's rows arrive per checkpoint tensor (q, k and v separately for a fused qkv_proj) and each may have
its own GGML type (Q4_K_M files mix types inside one fused layer), so the method collects parts and, after
loading, joins runs of the same type into segments: one kernel call per segment, their outputs side by side.
A layer any of whose rows came as floats (a type without a kernel, a tensor-parallel cut between blocks)
runs dequantized as one float matrix, exactly as without this method.

Q4_0 / Q4_1 / Q8_0 segments also get a copy repacked for the integer road (`ops/csrc/gguf_q4x16.cpp`,
`gguf_q8x16.cpp`: 16 output features interleaved per block, ~3x fewer instructions per weight than the file's
layout) where the CPU has AVX-512 VNNI and the segment's rows are a multiple of 16; the file's rows stay for the
prompt rows (the dequantizing road) and as the reference. Which rows take which road is their kind's
(`row_roads`). `RAYTP_GGUF_DECODE_PACK=0` (read at load) keeps the file's layout alone (A/B timing).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from model_exec.layers.quantization import row_roads
from model_exec.layers.quantization.base import (
    LinearLayer,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
    release,
)
from model_exec.layers.quantization.gguf_tensor import Q8_0, GGUFTensor
from ops.attention import cpu_kernels


def kernels_available() -> bool:
    """True when the C++ kernels are built with their AVX2 path (the block kernel's fast path)."""
    return cpu_kernels.load_error() is None and cpu_kernels.vectorized()


def gguf_linear(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: int,
    packed: torch.Tensor | None = None,
    road: int = row_roads.BY_ROWS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T for W's rows `raw` [N, bytes] in GGML type `qtype`'s block layout; `packed`: their
    `decode_pack` copy, which the integer road reads instead; `road`: `row_roads`' INTEGER, DEQUANT or BY_ROWS
    (the call's row count picks); `out`: a contiguous [rows, N] float32 tensor to write (and return)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.dtype != torch.float32:
        raise ValueError(f"GGUF block weights multiply float32 activations, got {rows.dtype}")
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    y = torch.ops.raytp_cpu.gguf_linear(rows, raw, qtype, packed, road, out)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], raw.shape[0])


def gguf_rows_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int, packed: torch.Tensor | None) -> torch.Tensor:
    """`gguf_linear` of a decoder layer's rows, each on its kind's road (`row_roads`): a step of one kind in one
    call; a mixed step (a prompt chunk beside decode rows) one call per run of a kind, from a view of x into its
    rows of the output, or with many runs one call per kind on its gathered rows, scattered back."""
    roads = row_roads.for_rows(x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1])
    if roads is None or roads.road != row_roads.BY_ROWS:
        return gguf_linear(x, raw, qtype, packed, row_roads.BY_ROWS if roads is None else roads.road)
    rows = x.reshape(-1, x.shape[-1])
    y = rows.new_empty(rows.shape[0], raw.shape[0])
    if roads.runs:  # each run written in place: no copy of x or of the output
        for at, n, road in roads.runs:
            gguf_linear(rows.narrow(0, at, n), raw, qtype, packed, road, y.narrow(0, at, n))
        return y if x.dim() == 2 else y.view(*x.shape[:-1], raw.shape[0])
    assert roads.generated is not None and roads.prompt is not None
    y[roads.generated] = gguf_linear(rows[roads.generated], raw, qtype, packed, row_roads.INTEGER)
    y[roads.prompt] = gguf_linear(rows[roads.prompt], raw, qtype, packed, row_roads.DEQUANT)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], raw.shape[0])


def decode_pack(raw: torch.Tensor, qtype: int) -> torch.Tensor | None:
    """The integer road's repacked copy of a segment's rows (Q4_0 / Q4_1: `gguf_q4x16.cpp`, Q8_0: `gguf_q8x16.cpp`;
    rows a multiple of 16, AVX-512 VNNI), else None."""
    if os.environ.get("RAYTP_GGUF_DECODE_PACK", "1") == "0":
        return None
    if qtype == Q8_0:
        packed = torch.ops.raytp_cpu.gguf_q8x16_pack(raw)
    else:
        packed = torch.ops.raytp_cpu.gguf_q4x16_pack(raw, qtype)
    return packed if packed.numel() > 0 else None


class GGUFLinearMethod(QuantizeMethodBase):
    """One per layer (`GGUFConfig.linear_method` makes a fresh one): it holds the layer's rows."""

    name = "gguf"

    def __init__(self) -> None:
        self.parts: list[tuple[int, torch.Tensor | GGUFTensor]] = []  # (first row, rows) as loaded
        self.segments: list[tuple[int, torch.Tensor]] = []  # (GGML type, block rows) after loading
        self.packed: list[torch.Tensor | None] = []  # per segment: its `decode_pack` copy, or None
        self.dense: UnquantizedLinearMethod | None = None  # set when the layer runs as floats

    def create_weights(
        self, layer: LinearLayer, input_size: int, output_size: int, params_dtype: torch.dtype | None
    ) -> None:
        # the parameter only carries the logical shape (loaders, LoRA and the loading checks read it)
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        release(weight)
        layer.weight = weight

    def load_rows(self, layer: LinearLayer, offset: int, rows: torch.Tensor | GGUFTensor) -> None:
        if rows.shape[1] != layer.weight.shape[1] or offset + rows.shape[0] > layer.weight.shape[0]:
            raise ValueError(
                f"checkpoint shard has shape {tuple(rows.shape)} at row {offset}, parameter wants "
                f"{tuple(layer.weight.shape)}"
            )
        if isinstance(rows, GGUFTensor):  # a copy of just the shard: the full tensor is dropped after loading
            kept: torch.Tensor | GGUFTensor = GGUFTensor(rows.raw.contiguous().clone(), rows.qtype, rows.in_features)
        else:
            kept = rows.detach().to(torch.float32).clone()
        self.parts = [p for p in self.parts if p[0] != offset] + [(offset, kept)]

    def process_weights_after_loading(self, layer: LinearLayer, panels: bool) -> bool:
        if self.segments:
            return True
        if self.dense is not None:
            return self.dense.process_weights_after_loading(layer, panels)
        parts = sorted(self.parts, key=lambda p: p[0])
        covered = 0
        for offset, rows in parts:
            if offset != covered:
                raise ValueError(f"GGUF rows [{covered}, {offset}) of a layer were never loaded")
            covered += rows.shape[0]
        if covered != layer.weight.shape[0]:
            raise ValueError(f"GGUF layer loaded {covered} of its {layer.weight.shape[0]} rows")
        self.parts = []
        blocks = [rows for _, rows in parts if isinstance(rows, GGUFTensor)]
        if len(blocks) == len(parts) and kernels_available():
            runs: list[tuple[int, list[torch.Tensor]]] = []
            for b in blocks:
                if runs and runs[-1][0] == b.qtype:
                    runs[-1][1].append(b.raw)
                else:
                    runs.append((b.qtype, [b.raw]))
            self.segments = [(qtype, torch.cat(raws) if len(raws) > 1 else raws[0]) for qtype, raws in runs]
            self.packed = [decode_pack(raw, qtype) for qtype, raw in self.segments]
            return True
        # some rows came as floats: the whole layer runs dequantized
        dense = torch.cat([r.dequantize() if isinstance(r, GGUFTensor) else r for _, r in parts])
        layer.weight.data = dense.to(layer.weight.dtype)
        self.dense = UnquantizedLinearMethod()
        return self.dense.process_weights_after_loading(layer, panels)

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dense is not None:
            return self.dense.apply(layer, x, bias)
        if not self.segments:
            raise RuntimeError("a GGUF linear layer ran before its weights were loaded and processed")
        if len(self.segments) == 1:  # the usual layer: one type throughout, one kernel call
            qtype, raw = self.segments[0]
            y = gguf_rows_linear(x, raw, qtype, self.packed[0])
        else:
            parts = zip(self.segments, self.packed, strict=True)
            y = torch.cat([gguf_rows_linear(x, raw, qtype, packed) for (qtype, raw), packed in parts], dim=-1)
        return y if bias is None else y.add_(bias)


class GGUFConfig(QuantizationConfig):
    """A GGUF checkpoint on the CPU road: linear layers (and the embedding / LM head) keep kernel-type blocks."""

    name = "gguf"

    def linear_method(self) -> QuantizeMethodBase:
        return GGUFLinearMethod()

    def keeps_gguf_blocks(self) -> bool:
        return True
