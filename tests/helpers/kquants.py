"""Q4_K and Q6_K blocks written in numpy, in GGML's layout (ggml-common.h), for the tests: the `gguf` package
can dequantize these types but not quantize them. The choice of scales is a plain min/max one (not llama.cpp's
searched `make_qkx2_quants`); the layout is what matters, and `quantize_kquant`'s blocks are checked against
the `gguf` package's `dequantize` (tests/ops/test_gguf_kquants.py).
"""

from __future__ import annotations

import numpy as np

Q4_K, Q6_K = 12, 14


def _round_clip(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(x), lo, hi)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b > 0, a / np.where(b > 0, b, 1.0), 0.0)


def _q4_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] uint8."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    mins = np.maximum(0.0, -sub.min(-1))  # w = scale q - min, q in 0..15
    scales = (sub.max(-1) + mins) / 15.0
    d = (scales.max(-1, keepdims=True) / 63.0).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63.0).astype(np.float16)
    sc = _round_clip(_safe_div(scales, d.astype(np.float32)), 0, 63).astype(np.uint8)
    m = _round_clip(_safe_div(mins, dmin.astype(np.float32)), 0, 63).astype(np.uint8)
    eff_scale = (d.astype(np.float32) * sc)[..., None]
    eff_min = (dmin.astype(np.float32) * m)[..., None]
    q = _round_clip(_safe_div(sub + eff_min, np.broadcast_to(eff_scale, sub.shape)), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate(
        (
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ),
        axis=-1,
    )
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # bytes 32c..: sub-block 2c low, 2c + 1 high
    return np.concatenate((d.view(np.uint8), dmin.view(np.uint8), packed_scales, qs), axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] uint8."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scales = np.abs(sub).max(-1) / 31.0
    d = (scales.max(-1, keepdims=True) / 127.0).astype(np.float16)
    sc = _round_clip(_safe_div(scales, d.astype(np.float32)), -128, 127).astype(np.int8)
    eff = (d.astype(np.float32) * sc)[..., None]
    q = (_round_clip(_safe_div(sub, np.broadcast_to(eff, sub.shape)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 128)  # per half of 128 weights
    ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)  # byte i: weight i low, weight 64 + i high
    hi = (q >> 4).reshape(n, 2, 4, 32)  # weights 32s..32s+31 in bits 2s..2s+1 of bytes 0..31
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate((ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8)), axis=-1).astype(
        np.uint8
    )


def quantize_kquant(weights: np.ndarray, qtype: int) -> np.ndarray:
    """float [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * block bytes] in GGML's layout."""
    rows, k = weights.shape
    if k % 256:
        raise ValueError(f"K = {k} is not a multiple of 256")
    if qtype not in (Q4_K, Q6_K):
        raise ValueError(f"GGML type {qtype} is not Q4_K or Q6_K")
    flat = np.ascontiguousarray(weights, dtype=np.float32).reshape(rows * k // 256, 256)
    blocks = _q4_k(flat) if qtype == Q4_K else _q6_k(flat)
    return np.ascontiguousarray(blocks.reshape(rows, -1))
