"""Rotary position embedding, rotate-half (GPT-NeoX) layout as Hugging Face Llama uses.

Supported rope types: default, linear (position interpolation), llama3 (Llama 3.1
frequency-dependent scaling). cos/sin are cached in float32 for every position up to
max_position_embeddings and cast to the activations' dtype on use, matching HF.

A model looks its step's angles up once (`angles`), and every layer applies them (`rotate_owned`)
to its queries and keys together, as one [T, q_heads + kv_heads, head_dim] view of the fused
projection: in place for float32 CPU tensors (ops/fused.py, one kernel instead of chunk, four
muls, sub, add and cat with their temporaries), a new tensor elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ops import fused


def compute_inv_freq(head_dim: int, base: float, rope_scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 for the given rope type."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    raise ValueError(f"unsupported rope type {rope_type!r}")


@dataclass(frozen=True)
class RopeAngles:
    """One step's rotary angles, looked up once and shared by every layer."""

    cos: torch.Tensor  # [T, 1, head_dim // 2] in the activations' dtype
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, heads, head_dim] and k [T, kv_heads, head_dim] at positions [T].

    One instance is shared by all layers of a model.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)
        positions = torch.arange(max_position_embeddings, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(positions, inv_freq)
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin, each [T, head_dim // 2]."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return cos, sin

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        cos, sin = self.cos_sin(positions)
        return RopeAngles(cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype))

    @staticmethod
    def rotate(angles: RopeAngles, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] (any heads: q, k, or both side by side) rotated; a new tensor.

        The torch reference that `rotate_owned`'s kernel matches bit for bit."""
        return _rotate(x, angles.cos, angles.sin)

    @staticmethod
    def rotate_owned(angles: RopeAngles, x: torch.Tensor) -> torch.Tensor:
        """`rotate` for an x the caller gives up: rotated in place where the fused kernel applies
        (float32 on the CPU; x may be a strided view, e.g. the q|k part of a fused projection, and
        keeps its strides), else a new tensor. Callers use only the result."""
        if fused.applies(x, angles.cos, angles.sin):
            return fused.rotate_half_rope_(x, angles.cos, angles.sin)
        return _rotate(x, angles.cos, angles.sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = self.angles(positions, q.dtype)
        return self.rotate(angles, q), self.rotate(angles, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
