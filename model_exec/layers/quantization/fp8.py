"""`quantization="fp8"` on CUDA (Ada, Hopper and later): vLLM's FP8 W8A8 linear layers on `torch._scaled_mm`.

Weights are float8_e4m3fn with one fp32 scale per output channel; activations are quantized per token at
each product (dynamic: amax over the row / 448), or with the checkpoint's static per-tensor `input_scale`.
`_scaled_mm(x_q [M, K], w_q^T [K, N], scale_a [M, 1], scale_b [1, N])` computes
(x_q * scale_a) @ (w_q * scale_b^T)^T with fp32 accumulation and writes bf16 (rowwise scaling's output type).

Two ways in, one product:
- a float checkpoint: rows load as floats through the unquantized method's loaders and tensor-parallel
  sharding; `process_weights_after_loading` (during load, before the profiler's after-load snapshot)
  quantizes each rank's rows per output channel and releases the float matrix, so KV sizing sees fp8 bytes;
- a pre-quantized checkpoint (`fp8_checkpoint.Fp8Checkpoint`): the fp8 `weight` loads as is, its
  `weight_scale` (per tensor or per channel) is cut with the weight's rows (`fp8_checkpoint.load_weight_scale`):
  per-tensor scales of fused parts (q/k/v) become per-channel rows, so nothing is requantized.

`_scaled_mm` wants K and N multiples of 16: a layer whose rank-local shape is not stays in float (logged).
Nothing here reads a tensor's value on the host (no `.item()`), so decode steps capture into CUDA graphs.
LoRA adds its products on top in the layer's forward, as on float weights.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from model_exec.layers.linear import ColumnParallelLinear, LinearBase
from model_exec.layers.quantization.base import LinearLayer, QuantizationConfig, UnquantizedLinearMethod, release
from model_exec.layers.quantization.fp8_checkpoint import Fp8Checkpoint, load_input_scale, load_weight_scale
from model_exec.layers.quantization.gguf_tensor import GGUFTensor

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row or token: scale 1e-12, values 0 (never a division by zero)
ALIGN = 16  # _scaled_mm: K and N multiples of 16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] floats -> (fp8 [N, K] contiguous, fp32 scales [N, 1]); weight ~= q * scale row by row."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), scale


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (fp8 [M, K], fp32 scales [M, 1]): each row's amax / 448, computed on the
    device; or one static per-tensor scale (a 0-d fp32 tensor) broadcast to every row."""
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    static_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for W = weight_t^T * scale_b^T: `weight_t` the fp8 [K, N] column-major
    transpose of a contiguous [N, K], `scale_b` fp32 [1, N]. Output in x's dtype (bfloat16)."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, scale_a = quantize_per_token(rows, static_scale)
    y = torch._scaled_mm(x_q, weight_t, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=x.dtype)
    return y.view(*x.shape[:-1], weight_t.shape[1])


def refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why quantization='fp8' cannot run here, or None. Rowwise-scaled `_scaled_mm` runs on CUDA devices of
    compute capability 8.9 (Ada) and up, and writes bfloat16."""
    if device.type != "cuda":
        return f"it runs on CUDA devices of compute capability 8.9 or higher (Ada, Hopper); here: {device.type}"
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"it needs compute capability 8.9 or higher (Ada, Hopper); this device has {major}.{minor}"
    if dtype != torch.bfloat16:
        return f"it runs with dtype='bfloat16' (rowwise-scaled FP8 products write bfloat16); asked: {dtype}"
    return None


class Fp8LinearMethod(UnquantizedLinearMethod):
    """One per layer. Without `checkpoint`: float rows, quantized after loading; with it: fp8 rows + scales."""

    name = "fp8"

    def __init__(self, checkpoint: Fp8Checkpoint | None = None) -> None:
        self.checkpoint = checkpoint
        self.weight_t: torch.Tensor | None = None  # fp8 [K, N], column-major (a contiguous [N, K] transposed)
        self.scale_b: torch.Tensor | None = None  # fp32 [1, N]
        self.input_scale: torch.Tensor | None = None  # fp32 0-d, with a checkpoint's static activation scales
        self.params_dtype: torch.dtype | None = None
        # a checkpoint's scale parameters (registered on the layer as `weight_scale`, `input_scale`)
        self.weight_scale: nn.Parameter | None = None
        self.input_scales: nn.Parameter | None = None  # one per fused part

    def create_weights(
        self, layer: LinearLayer, input_size: int, output_size: int, params_dtype: torch.dtype | None
    ) -> None:
        self.params_dtype = params_dtype
        if self.checkpoint is None:
            super().create_weights(layer, input_size, output_size, params_dtype)
            return
        # the checkpoint's scales register on the layer and load through its loaders, cut with its rows
        assert isinstance(layer, LinearBase)
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8), requires_grad=False)
        scale = nn.Parameter(torch.empty(output_size, 1, dtype=torch.float32), requires_grad=False)
        scale.weight_loader = partial(load_weight_scale, layer)  # type: ignore[attr-defined]
        layer.weight_scale = self.weight_scale = scale
        if self.checkpoint.static_input:
            parts = len(layer.output_parts()) if isinstance(layer, ColumnParallelLinear) else 1
            inp = nn.Parameter(torch.empty(parts, dtype=torch.float32), requires_grad=False)
            inp.weight_loader = partial(load_input_scale, layer)  # type: ignore[attr-defined]
            layer.input_scale = self.input_scales = inp

    def load_rows(self, layer: LinearLayer, offset: int, rows: torch.Tensor | GGUFTensor) -> None:
        if self.checkpoint is not None and (isinstance(rows, GGUFTensor) or rows.dtype != FP8):
            kind = "GGUF blocks" if isinstance(rows, GGUFTensor) else rows.dtype
            raise ValueError(
                f"the FP8 checkpoint ({self.checkpoint.describe}) holds {kind} for a linear layer it quantizes"
            )
        super().load_rows(layer, offset, rows)

    def process_weights_after_loading(self, layer: LinearLayer, panels: bool) -> bool:
        if self.weight_t is not None:
            return True
        n, k = layer.weight.shape
        if n % ALIGN or k % ALIGN:
            logger.info(
                "fp8: a layer of %d x %d per rank (not multiples of %d) runs in %s", n, k, ALIGN, self.params_dtype
            )
            if self.weight_scale is not None:  # dequantize: the float path multiplies params_dtype weights
                w = layer.weight.data.float() * self.weight_scale.data
                layer.weight.data = w.to(self.params_dtype or torch.get_default_dtype())
                self.checkpoint, self.weight_scale = None, None
            return super().process_weights_after_loading(layer, panels)
        if self.checkpoint is None:
            q, scale = quantize_per_channel(layer.weight.data)
            release(layer.weight)
        else:
            assert self.weight_scale is not None
            q, scale = layer.weight.data, self.weight_scale.data
            if self.input_scales is not None:
                self.input_scale = self.input_scales.data.max()  # vLLM: the fused parts share the largest
            # the parameter keeps its logical shape in the float dtype (LoRA casts its adapters to it), no memory
            release(layer.weight, self.params_dtype)
        self.weight_t = q.t()
        self.scale_b = scale.reshape(1, n).contiguous()
        return True

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_t is None or self.scale_b is None:
            return super().apply(layer, x, bias)
        return fp8_linear(x, self.weight_t, self.scale_b, bias, self.input_scale)

    def dequantized(self) -> torch.Tensor:
        """The weights the product multiplies with, as fp32 [N, K] (tests compare against them)."""
        assert self.weight_t is not None and self.scale_b is not None
        return self.weight_t.t().float() * self.scale_b.t()


class Fp8Config(QuantizationConfig):
    """Every linear layer FP8 (the embedding, LM head and MoE experts stay in float)."""

    name = "fp8"

    def __init__(self, checkpoint: Fp8Checkpoint | None = None) -> None:
        self.checkpoint = checkpoint

    def linear_method(self) -> Fp8LinearMethod:
        return Fp8LinearMethod(self.checkpoint)
