"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops import fused


class SiluAndMul(nn.Module):
    """[..., 2d] (gate | up) -> silu(gate) * up, [..., d].

    float32 CPU tensors go through one fused kernel (ops/fused.py; its exp is within about an ulp
    of torch's); `forward_torch` is the reference.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.applies(x):
            return fused.silu_and_mul(x)
        return self.forward_torch(x)

    @staticmethod
    def forward_torch(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
