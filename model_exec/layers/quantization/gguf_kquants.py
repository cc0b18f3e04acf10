"""GGML's K-quant super-blocks (Q4_K, Q6_K) dequantized in torch ops: an embedding lookup's few rows per step
kept in those types (Q4_K_M files store token_embd as Q4_K or Q6_K). The layouts are ggml-common.h's (see
`ops/csrc/gguf_kquants.cpp`); the values are the `gguf` package's numpy `dequantize`, bit for bit
(tests/ops/test_gguf_kquants.py).
"""

from __future__ import annotations

import torch

Q4_K, Q6_K = 12, 14  # GGML type ids
SUPER = 256  # weights per super-block


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at bytes [start, start + 2) of every super-block, as float32 [..., 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 144] super-blocks -> [..., 256] weights: d sc[j] q - dmin m[j] per 32-weight sub-block j."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    s = blocks[..., 4:16].long()
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits, 4-7 split over a nibble and the 2 top bits
    sc = torch.cat((lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)), dim=-1)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)  # 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-2).reshape(*blocks.shape[:-1], 8, 32).float()
    return (d.unsqueeze(-1) * sc.unsqueeze(-1).float() * q - dmin.unsqueeze(-1) * mn.unsqueeze(-1).float()).flatten(-2)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 210] super-blocks -> [..., 256] weights: d scales[i / 16] (q - 32), q = 4 low bits | 2 high."""
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 1, 64)  # per half: low nibbles weights 0..63, high 64..127
    ql = torch.cat((ql & 0x0F, ql >> 4), dim=-2).reshape(*lead, 2, 128)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)  # per half: bits 2s..2s+1 weights 32s..32s+31
    qh = torch.cat([(qh >> (2 * s)) & 0x03 for s in range(4)], dim=-2).reshape(*lead, 2, 128)
    q = ((ql | (qh << 4)).long() - 32).reshape(*lead, 16, 16).float()
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    return (_half(blocks, 208).unsqueeze(-1) * scales.unsqueeze(-1) * q).flatten(-2)


def dequantize_kquant_rows(raw: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """float32 [rows, K] from Q4_K / Q6_K rows `raw` uint8 [rows, K / 256 * block bytes]."""
    if qtype not in (Q4_K, Q6_K):
        raise ValueError(f"GGML type {qtype} is not a K-quant with a kernel (Q4_K=12, Q6_K=14)")
    rows = raw.shape[0]
    blocks = raw.reshape(rows, in_features // SUPER, 144 if qtype == Q4_K else 210)
    values = _q4_k(blocks) if qtype == Q4_K else _q6_k(blocks)
    return values.reshape(rows, in_features)
