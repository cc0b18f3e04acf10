"""Triton kernels for a decoder layer's elementwise steps on CUDA: one launch per step instead of a chain.

On the GPU a decode step is launch-bound (issue 42: ~25 small kernels per decoder layer: RMSNorm as
pow/mean/rsqrt/mul, rotary as chunk/mul/sub/cat, SiLU times up, residual adds, dtype copies). These replace
them with four kernels; the layers call them through `ops.fused_cuda` on CUDA tensors.

Each kernel reproduces its torch reference's roundings, not only its arithmetic: every intermediate that torch
stores in the activation dtype (bf16/fp16) is rounded to it here too (`_round`), so the results equal the
unfused ops' up to the order of one row's sum of squares (RMSNorm) and the last bit of exp (SiLU):

- `add_rms_norm`: residual = x + residual (in the dtype), then Llama's norm: in float32, cast back, times the
  weight (`cast_first`), or Gemma's: all in float32 times the float32 scale, cast at the end;
- `rotate_half_`: x1 * cos - x2 * sin | x2 * cos + x1 * sin, each product and sum rounded, in place;
- `silu_and_mul`: silu(gate) rounded, times up.

Semantics are vLLM's (and ops/fused.py's): the add-norm and the rotation overwrite their inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (float32) rounded to `dtype` and widened back: a value torch would have stored."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, w_ptr, n_cols, x_stride, res_stride, out_stride, eps,
    HAS_RESIDUAL: tl.constexpr, CAST_FIRST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    dtype = x.dtype
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h = _round(h + r, dtype)
        tl.store(res_ptr + row * res_stride + cols, h.to(dtype), mask=mask)
    var = tl.sum(h * h, axis=0) / n_cols
    y = h * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if CAST_FIRST:  # noqa: SIM108 - a constexpr branch: each variant compiles only its side
        # Llama: normalise in float32, cast back, multiply by the weight in its dtype
        y = _round(y, dtype) * w.to(tl.float32)
    else:  # Gemma: times the float32 scale, cast once at the end
        y = y * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(dtype), mask=mask)


@triton.jit
def _rotate_half_kernel(
    x_ptr, cos_ptr, sin_ptr, x_tok_stride, x_head_stride, cos_stride, sin_stride,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = x_ptr + tok * x_tok_stride + head * x_head_stride
    x1 = tl.load(base + cols, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + tok * cos_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * sin_stride + cols, mask=mask, other=0.0).to(tl.float32)
    o1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)
    o2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    tl.store(base + cols, o1.to(dtype), mask=mask)
    tl.store(base + HALF + cols, o2.to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] (a view for the contiguous activations the layers pass)."""
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool = True) -> torch.Tensor:
    """A new tensor: x normalised over its last dim (see the module note for `cast_first`)."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    n = rows.shape[-1]
    _rms_norm_kernel[(rows.shape[0],)](
        rows, rows, out, weight, n, rows.stride(0), rows.stride(0), out.stride(0), eps,
        HAS_RESIDUAL=False, CAST_FIRST=cast_first, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out.view_as(x)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then x = norm(residual), both in place (contiguous rows); returns (x, residual)."""
    rows, res = _rows(x), _rows(residual)
    n = rows.shape[-1]
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res, rows, weight, n, rows.stride(0), res.stride(0), rows.stride(0), eps,
        HAS_RESIDUAL=True, CAST_FIRST=cast_first, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return x, residual


def rotate_half_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, rotary_dim] (any token/head strides, last dim contiguous) in place by cos/sin
    [T, 1, rotary_dim / 2] (any token stride, last dim contiguous); returns x."""
    tokens, heads, dim = x.shape
    if tokens == 0:
        return x
    half = dim // 2
    _rotate_half_kernel[(tokens, heads)](
        x,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
    )
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] (gate | up) -> silu(gate) * up, [..., d], a new tensor."""
    rows = _rows(x)
    d = rows.shape[-1] // 2
    out = rows.new_empty((rows.shape[0], d))
    if rows.shape[0]:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            rows, out, d, rows.stride(0), out.stride(0), BLOCK=block
        )
    return out.view(*x.shape[:-1], d)
