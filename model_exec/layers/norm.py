"""RMSNorm, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from ops import fused


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back (as HF Llama does).

    `forward(x, residual)` first adds the residual and returns (normed, new_residual),
    so a decoder layer carries the un-normalised stream without an extra add. It may do so in
    place (float32 on the CPU: one fused kernel writes the sum into `residual` and the normed
    values into `x`, vLLM's `fused_add_rms_norm`), so callers hand over both tensors and use only
    what it returns. `forward_torch` is the reference, exact against HF's LlamaRMSNorm; the
    kernel differs from it only in the order the squares are summed (a few ulp).
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
            if fused.applies(x, self.weight):
                return fused.rms_norm(x, self.weight, self.eps)
            return self._norm(x)
        if fused.applies(x, residual, self.weight):
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return self.forward_torch(x, residual)

    def forward_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch reference: same results as `forward`, never in place."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
