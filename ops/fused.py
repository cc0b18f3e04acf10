"""Fused CPU kernels for a decoder layer's elementwise steps (`csrc/fused_layers.cpp`).

A decode step of a small model is dominated by per-op overhead, not arithmetic: RMSNorm is seven
torch ops, rotate-half RoPE eight, SiLU-and-mul three, each a dispatch plus a pass over memory and
a temporary (~270 aten::mul calls per SmolLM2-135M decode step). One kernel call replaces each chain.

Measured on 2 shared cores (figures noisy), `python -m benchmarks.fused_layers_bench`: SmolLM2-135M
shapes, best of 7 x 200 calls through the layers' `forward` against their torch code, us per call
(torch -> fused):

    rows            add+RMSNorm    RMSNorm        rotary q|k     SiLU-and-mul
    1               20.6 -> 5.6    13.9 -> 5.6    9.8 -> 2.8     4.5 -> 5.0
    16              19.8 -> 6.4    17.0 -> 6.6    16.2 -> 4.3    17.9 -> 14.7
    512 (prefill)   108 -> 35      75 -> 28       163 -> 34      340 -> 188 (torch up to 2,300)

So ~45 -> ~18 us per layer for one decode row, ~0.8 ms of a ~27 ms token over 30 layers. In
`python -m benchmarks.step_profile --workload single --num-prompts 2 --input-len 128 128
--output-len 64 64 --profile torch`, the 60 profiled steps went 3.16 -> 2.49 s and aten::mul
(273 calls per step), add, pow, mean, silu and cat left the top 25 ops; `--workload offline
--num-prompts 16`: 303 -> 341 total tok/s. One A/B pair each on a shared machine, where repeated
single-stream runs of either side vary by +-10%: the per-call figures above are the firm ones.

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
    out = x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))
    torch.ops.raytp_cpu.silu_and_mul(out, x)
    return out
