"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops import fused, fused_cuda


class SiluAndMul(nn.Module):
    """[..., 2d] (gate | up) -> silu(gate) * up, [..., d].

    float32 CPU tensors go through one fused kernel (ops/fused.py; its exp is within about an ulp
    of torch's), CUDA tensors through a Triton one (ops/triton_layers.py); `forward_torch` is the reference.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_cuda.applies(x):  # CUDA: one Triton kernel
            return fused_cuda.kernels().silu_and_mul(x)
        if fused.applies(x):
            return fused.silu_and_mul(x)
        return self.forward_torch(x)

    @staticmethod
    def forward_torch(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """[..., 2d] (gate | up) -> gelu_tanh(gate) * up, [..., d]: HF's `gelu_pytorch_tanh` gated MLP (Gemma).

    torch's own tanh-approximated gelu, the op HF calls, so the results are HF's bit for bit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GeluAndMul(nn.Module):
    """[..., 2d] (gate | up) -> gelu(gate) * up, [..., d]: HF's `gelu` (exact, erf) gated MLP, as torch computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate) * up


# HF `hidden_act` name -> the gated activation (model_exec.config.HIDDEN_ACTS lists the same names; the
# encoders' plain, ungated `gelu` is model_exec/models/bert.py's own)
ACT_AND_MUL: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu": GeluAndMul,
}


def act_and_mul(name: str) -> nn.Module:
    """The gated activation HF calls `name`; ValueError for one not implemented."""
    if name not in ACT_AND_MUL:
        raise ValueError(f"unsupported hidden_act {name!r}; implemented: {', '.join(ACT_AND_MUL)}")
    return ACT_AND_MUL[name]()
