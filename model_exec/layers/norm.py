"""RMSNorm, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back (as HF Llama does).

    `forward(x, residual)` first adds the residual and returns (normed, new_residual),
    so a decoder layer carries the un-normalised stream without an extra add.
    """

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
