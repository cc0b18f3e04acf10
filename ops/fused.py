"""Fused CPU kernels for a decoder layer's elementwise steps (`csrc/fused_layers.cpp`).

A decode step of a small model is dominated by per-op overhead, not arithmetic: RMSNorm is seven
torch ops, rotate-half RoPE eight, SiLU-and-mul three, each a dispatch plus a pass over memory and
a temporary. One kernel call per step replaces each chain. Measured on SmolLM2-135M, 2 shared
cores (`python -m benchmarks.step_profile --workload single --num-prompts 2 --input-len 128 128
--output-len 64 64`): see the figures in model_exec/layers/norm.py.

`applies(*tensors)` is the one gate the model layers ask: float32 CPU tensors, and the kernel
library built and loaded (`ops.attention.cpu_kernels.load_error()`, cached after the first call).
Everything else (other dtypes, GPUs, a machine without a compiler) keeps the layers' torch code,
which stays the reference the tests compare these kernels against.

Semantics are vLLM's: `fused_add_rms_norm` and `rotate_half_rope_` overwrite their inputs.
"""

from __future__ import annotations

import torch

from ops.attention import cpu_kernels


def applies(*tensors: torch.Tensor) -> bool:
    """True when every tensor is float32 on the CPU with a contiguous last dim, and the kernels are loaded."""
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1:
            return False
    return cpu_kernels.load_error() is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, into a new tensor."""
    out = torch.empty_like(x)
    torch.ops.raytp_cpu.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then x = residual / rms(residual) * weight, both in place; returns (x, residual)."""
    torch.ops.raytp_cpu.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotate_half_rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate qk [T, heads, head_dim] (any row/head strides) in place by cos/sin [T, (1,) head_dim/2]; returns qk."""
    torch.ops.raytp_cpu.rotate_half_rope(qk, cos, sin)
    return qk


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] (gate | up) -> silu(gate) * up, [..., d], a new tensor."""
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    torch.ops.raytp_cpu.silu_and_mul(out, x)
    return out
