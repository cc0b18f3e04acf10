"""Quantized weights: per-linear methods (`base`), GGUF blocks kept on the CPU (`gguf`, `gguf_tensor`)."""

from model_exec.layers.quantization.base import (
    LinearLayer,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
    copy_shard,
    current,
    linear_method,
    scope,
)
from model_exec.layers.quantization.gguf_tensor import GGUFTensor, as_float

__all__ = [
    "GGUFTensor",
    "LinearLayer",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "UnquantizedLinearMethod",
    "as_float",
    "copy_shard",
    "current",
    "linear_method",
    "scope",
]
