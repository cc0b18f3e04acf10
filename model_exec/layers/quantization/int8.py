"""`quantization="int8"`: weight-only int8 computed at load from a float checkpoint, on the CPU road.

Each linear layer's rows load as floats (the same loaders and TP sharding as unquantized), then
`process_weights_after_loading` quantizes them per group of 32 input features with an fp16 scale: exactly
GGUF's Q8_0 block (`d = max|w| / 127`, `q = round(w / d)`), so the product runs on the same block kernel
(`ops/csrc/gguf_gemm.cpp`: a generated row on the integer road, `gguf_q8x16.cpp`'s repacked copy where the CPU
has AVX-512 VNNI, a prompt row dequantized to fp32 panels by `gguf_dequant_gemm.cpp`) and reads 1.06 bytes per
weight instead of 4. Per-group rather than
per-output-channel scales: one scale per 32 weights follows outliers inside a row that a per-row scale
cannot, at 6% more bytes. A layer whose rank-local input size is not a multiple of 32 stays in floats (logged).
LoRA adapters add their products on top as on float weights (the layer's forward, not the method).
"""

from __future__ import annotations

import logging

import torch

from model_exec.layers.quantization.base import LinearLayer, QuantizationConfig, UnquantizedLinearMethod, release
from model_exec.layers.quantization.gguf import decode_pack, gguf_rows_linear, kernels_available
from model_exec.layers.quantization.gguf_tensor import BLOCK, Q8_0, GGUFTensor

logger = logging.getLogger(__name__)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] floats (K a multiple of 32) -> [N, K / 32 * 34] uint8 Q8_0 blocks (fp16 d, then 32 int8)."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (groups.abs().amax(-1, keepdim=True) / 127.0).half()
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(groups * inv).clamp_(-127, 127).to(torch.int8)
    blocks = torch.cat((d.view(torch.uint8).reshape(n, k // BLOCK, 2), q.view(torch.uint8)), dim=-1)
    return blocks.reshape(n, k // BLOCK * 34).contiguous()


class Int8LinearMethod(UnquantizedLinearMethod):
    """Loads like the unquantized method, then keeps only Q8_0 blocks of the rows."""

    name = "int8"

    def __init__(self) -> None:
        self.blocks: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None  # the blocks' integer-road copy (`gguf.decode_pack`)

    def process_weights_after_loading(self, layer: LinearLayer, panels: bool) -> bool:
        if self.blocks is not None:
            return True
        in_features = layer.weight.shape[1]
        if in_features % BLOCK or not kernels_available():
            logger.info("int8: a layer with %d input features per rank stays in float32", in_features)
            return super().process_weights_after_loading(layer, panels)
        self.blocks = quantize_q8_0(layer.weight.data)
        self.packed = decode_pack(self.blocks, Q8_0)
        release(layer.weight)
        return True

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.blocks is None:
            return super().apply(layer, x, bias)
        y = gguf_rows_linear(x, self.blocks, Q8_0, self.packed)
        return y if bias is None else y.add_(bias)

    def dequantized(self) -> torch.Tensor:
        """The weights the kernel multiplies with, as floats (tests compare against them)."""
        assert self.blocks is not None
        return GGUFTensor(self.blocks, Q8_0, self.blocks.shape[1] // 34 * BLOCK).dequantize()


class Int8Config(QuantizationConfig):
    name = "int8"

    def linear_method(self) -> Int8LinearMethod:
        return Int8LinearMethod()
