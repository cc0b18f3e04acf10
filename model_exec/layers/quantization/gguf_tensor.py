"""A GGUF tensor kept in its block layout while it streams from the file to a layer's shard.

`GGUFTensor` stands in for the full float checkpoint tensor a weight_loader receives: it has the float
tensor's logical `shape` and the few view operations the loaders use to cut a rank's shard (`narrow`,
`split` along the rows; `narrow` along the input features at block boundaries), so the loaders and the
tensor-parallel sharding are the same code for float and quantized weights. Anything else that reaches a
GGUFTensor (a norm, an expert, a cut between blocks) gets its exact float values through `dequantize()`.

Block layouts and the dequantization of the kernel types are GGML's (ggml-quants.c); the `gguf` package's
numpy `dequantize` is the reference for every type, these only serve embedding lookups. Q8_0/Q4_0/Q4_1 have
blocks of 32 weights, Q4_K/Q6_K super-blocks of 256: a cut along the input features keeps blocks only on
its type's block boundaries.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from model_exec.layers.quantization.gguf_kquants import dequantize_kquant_rows


class KernelType(NamedTuple):
    name: str
    block: int  # weights per block
    bytes: int  # bytes per block


# GGML type ids (gguf.GGMLQuantizationType) with a kernel in ops/csrc/gguf_gemm.cpp (Q4_K, Q6_K: gguf_kquants.cpp)
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
KERNEL_TYPES: dict[int, KernelType] = {
    Q4_0: KernelType("Q4_0", 32, 18),
    Q4_1: KernelType("Q4_1", 32, 20),
    Q8_0: KernelType("Q8_0", 32, 34),
    Q4_K: KernelType("Q4_K", 256, 144),
    Q6_K: KernelType("Q6_K", 256, 210),
}
BLOCK = 32  # weights per block of Q8_0 (int8's own blocks) and the other 32-block types


class GGUFTensor:
    """Rows of a GGUF matrix in block layout: `raw` uint8 [rows, K / 32 * block bytes], logical shape [rows, K]."""

    def __init__(self, raw: torch.Tensor, qtype: int, in_features: int) -> None:
        if qtype not in KERNEL_TYPES:
            raise ValueError(f"GGML type {qtype} is not kept in blocks")
        kind = KERNEL_TYPES[qtype]
        if raw.dtype != torch.uint8 or raw.dim() != 2 or in_features % kind.block:
            raise ValueError(f"GGUFTensor wants uint8 rows of whole {kind.block}-weight {kind.name} blocks")
        if raw.shape[1] != in_features // kind.block * kind.bytes:
            raise ValueError(f"{raw.shape[1]} bytes per row do not hold {in_features} {self.type_name} weights")
        self.raw, self.qtype, self.in_features = raw, qtype, in_features

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES[self.qtype].name

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.in_features))

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor | torch.Tensor:
        """Rows (dim 0) or input features (dim 1) [start, start + length): a block-layout view when the cut
        falls on block boundaries, else the exact float values (the layer then runs dequantized)."""
        if dim == 0:
            return GGUFTensor(self.raw.narrow(0, start, length), self.qtype, self.in_features)
        if dim != 1:
            raise IndexError(f"a GGUF matrix has 2 dims, not {dim + 1}")
        kind = KERNEL_TYPES[self.qtype]
        if start % kind.block or length % kind.block:  # inside a (super-)block
            return self.dequantize().narrow(1, start, length)
        first, count = start // kind.block * kind.bytes, length // kind.block * kind.bytes
        return GGUFTensor(self.raw.narrow(1, first, count), self.qtype, length)

    def split(self, sizes: list[int], dim: int = 0) -> tuple[GGUFTensor, ...]:
        if dim != 0:
            raise ValueError("GGUF matrices split along their rows only")
        return tuple(GGUFTensor(part, self.qtype, self.in_features) for part in self.raw.split(sizes, dim=0))

    def index_rows(self, index: torch.Tensor) -> GGUFTensor:
        """Rows reordered (llama.cpp's q/k permutation undone): whole rows move, blocks untouched."""
        return GGUFTensor(self.raw.index_select(0, index), self.qtype, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The exact float32 values, [rows, K] (the `gguf` package's reference dequantization)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        array = dequantize(self.raw.contiguous().numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).view(self.shape)


def dequantize_rows(raw: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """float32 [rows, K] from block-layout rows `raw` [rows, bytes]: the same values as `GGUFTensor.dequantize`,
    in torch ops (an embedding lookup's few rows per step)."""
    if KERNEL_TYPES[qtype].block != BLOCK:
        return dequantize_kquant_rows(raw, qtype, in_features)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, in_features // BLOCK, KERNEL_TYPES[qtype].bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if qtype == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, in_features)
    nibbles = blocks[..., 4:] if qtype == Q4_1 else blocks[..., 2:]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).float()  # weight j < 16: low nibble of byte j
    if qtype == Q4_1:
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        return (d * q + m).reshape(rows, in_features)
    return (d * (q - 8.0)).reshape(rows, in_features)


def as_float(t: torch.Tensor | GGUFTensor) -> torch.Tensor:
    """A checkpoint tensor as float values, whichever form it came in."""
    return t.dequantize() if isinstance(t, GGUFTensor) else t
