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

    def kernel_weight(self) -> torch.Tensor:
        """The vector the fused kernels multiply the normalised rows by."""
        return self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        weight = self.kernel_weight()
        if residual is None:
            if fused.applies(x, weight):
                return fused.rms_norm(x, weight, self.eps)
            return self._norm(x)
        if fused.applies(x, residual, weight):
            return fused.fused_add_rms_norm(x, residual, weight, self.eps)
        return self.forward_torch(x, residual)

    def forward_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch reference: same results as `forward`, never in place."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32, cast back at the end (HF's
    Gemma2RMSNorm/Gemma3RMSNorm; Llama's casts before the multiply instead).

    The parameter holds the checkpoint's `weight` in the model's dtype; loading it also computes the
    float32 `scale` = 1 + weight that every forward multiplies by, the value HF computes per call, so
    the fused float32 kernels (which take any weight vector) serve it unchanged.
    """

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, params_dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.ones(hidden_size, dtype=torch.float32), persistent=False)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if loaded_weight.shape != param.shape:
            raise ValueError(
                f"checkpoint norm has shape {tuple(loaded_weight.shape)}, parameter wants {tuple(param.shape)}"
            )
        param.data.copy_(loaded_weight)
        self.scale.copy_(1.0 + param.data.float())  # from the parameter: the rounding HF's forward sees

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.scale).to(x.dtype)

    def kernel_weight(self) -> torch.Tensor:
        return self.scale


def per_head_norm(norm: RMSNorm, x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """x [T, num_heads * head_dim] (q or k; may be a strided slice of a fused projection) with each head
    normalised by `norm` (of head_dim features: Qwen3's and Gemma 3's q/k norms), as a new tensor
    [T, num_heads, head_dim]. The weights are per feature, not per head, so every TP rank applies the same
    replicated norm to its own heads. One row per head: reshape copies strided slices into the rows the
    norm kernels take."""
    return norm(x.reshape(-1, norm.weight.shape[0])).view(x.shape[0], num_heads, -1)
