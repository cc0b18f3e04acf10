"""The per-linear quantization method (vLLM's `QuantizeMethodBase` shape) and how a layer gets one.

A linear layer owns its tensor-parallel geometry (which rows of which checkpoint tensor are its shard);
its method owns everything about the weight's representation: the parameter it allocates
(`create_weights`), how a shard's rows are stored (`load_rows`), the layout it moves into once all are
loaded (`process_weights_after_loading`) and the product (`apply`). So one loader and one sharding serve
float, GGUF-block and int8 weights alike.

Which method a layer gets is decided once per model, before it is built: `model_exec.shard` opens a
`scope(config)` around `build_model`, and every linear layer constructed inside asks the scope's config
(`linear_method()`). Model family files never name a quantization.

Layering: `model_exec.layers.linear` builds its layers on this module, so a method sees its layer only through
`LinearLayer`, the attributes every method reads or sets; a method that needs a layer's geometry (fp8's
per-part scales) imports the layer classes itself, from above, as any user of the layers does.
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from model_exec.layers import cpu_gemm
from model_exec.layers.quantization.gguf_tensor import GGUFTensor, as_float


class LinearLayer(Protocol):
    """A linear layer as its quantization method sees it (`model_exec.layers.linear.LinearBase` is one)."""

    weight: nn.Parameter  # logical shape [output_size, input_size], whatever the method keeps behind it
    panel_weight: torch.Tensor | None  # the unquantized method's packed copies (at most one is set)
    packed_weight: torch.Tensor | None


def copy_shard(dst: torch.Tensor, src: torch.Tensor | GGUFTensor) -> None:
    """dst.copy_(src) that refuses to broadcast: a shape mismatch means checkpoint and config disagree.
    GGUF blocks reaching a float parameter (norms, experts) copy their exact float values."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint shard has shape {tuple(src.shape)}, parameter wants {tuple(dst.shape)}")
    dst.copy_(as_float(src))


class QuantizeMethodBase(ABC):
    """How one linear layer's weight is held and multiplied."""

    name: str = "none"

    @abstractmethod
    def create_weights(
        self, layer: LinearLayer, input_size: int, output_size: int, params_dtype: torch.dtype | None
    ) -> None:
        """Set `layer.weight`: a Parameter of logical shape [output_size, input_size] (what loaders, LoRA and
        the loading checks see), whatever memory the method keeps behind it."""

    @abstractmethod
    def load_rows(self, layer: LinearLayer, offset: int, rows: torch.Tensor | GGUFTensor) -> None:
        """Store this rank's rows [offset, offset + len) of the weight (already cut to the shard's input
        features), given as floats or as GGUF blocks."""

    @abstractmethod
    def process_weights_after_loading(self, layer: LinearLayer, panels: bool) -> bool:
        """Move the loaded weight into its compute layout; True if the layer now runs a packed/quantized
        kernel (`panels`: EngineConfig.cpu_panel_gemm for float weights)."""

    @abstractmethod
    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias) for x [..., input_size]."""


def release(param: nn.Parameter, dtype: torch.dtype | None = None) -> None:
    """Keep the parameter's shape and dtype (or take `dtype`) but no memory (a zero-stride view of one element):
    loading into it afterwards fails loudly instead of writing a matrix nobody reads."""
    param.data = torch.empty(1, dtype=dtype or param.dtype, device=param.device).expand(param.shape)


class UnquantizedLinearMethod(QuantizeMethodBase):
    """Float weights: dense, then raytp's panels or oneDNN's layout on the CPU in fp32 (`cpu_gemm`)."""

    name = "none"

    def create_weights(
        self, layer: LinearLayer, input_size: int, output_size: int, params_dtype: torch.dtype | None
    ) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)

    def load_rows(self, layer: LinearLayer, offset: int, rows: torch.Tensor | GGUFTensor) -> None:
        copy_shard(layer.weight.data.narrow(0, offset, rows.shape[0]), rows)

    def process_weights_after_loading(self, layer: LinearLayer, panels: bool) -> bool:
        if layer.panel_weight is not None or layer.packed_weight is not None:
            return True
        copies = cpu_gemm.pack(layer.weight, panels)
        if copies is None:
            return False
        layer.panel_weight, layer.packed_weight = copies
        release(layer.weight)
        return True

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemm.linear(x, layer.weight, layer.panel_weight, layer.packed_weight, bias)


class QuantizationConfig(ABC):
    """A model-wide choice of quantization: hands each linear layer its method."""

    name: str = "none"

    @abstractmethod
    def linear_method(self) -> QuantizeMethodBase: ...

    def keeps_gguf_blocks(self) -> bool:
        """True when GGUF tensors of the kernel types should reach the layers in block layout."""
        return False


_SCOPE: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar("raytp_quantization", default=None)


@contextlib.contextmanager
def scope(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers built inside get `config`'s methods (None: unquantized)."""
    token = _SCOPE.set(config)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current() -> QuantizationConfig | None:
    return _SCOPE.get()


def linear_method() -> QuantizeMethodBase:
    """The method for a linear layer being built now."""
    config = _SCOPE.get()
    return UnquantizedLinearMethod() if config is None else config.linear_method()
