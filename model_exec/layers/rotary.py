"""Rotary position embedding, rotate-half (GPT-NeoX) layout as Hugging Face Llama uses.

Rope types, each computed as transformers' `modeling_rope_utils` does (same float32 arithmetic, so
the angles are bit-equal): default, linear (position interpolation), llama3 (Llama 3.1 frequency
bands), yarn (NTK-by-parts with its attention factor), longrope (Phi-3's short/long per-frequency
factors with its attention factor) and dynamic (NTK base rescaled by the sequence length). Partial
rotary (`rotary_dim` < head_dim, HF's `partial_rotary_factor`) rotates the first `rotary_dim`
features of each head and passes the rest through. cos/sin are cached in float32 and cast to the
activations' dtype on use, matching HF; an attention factor multiplies both, as HF does.

Length-dependent types (longrope, dynamic). HF picks their frequencies per forward from
`seq_len = max(position_ids) + 1`: longrope takes the long factors when seq_len exceeds
`original_max_position_embeddings`, else the short ones; dynamic rescales the base once seq_len
exceeds `max_position_embeddings`. raytp applies the same rule per sequence and per step: a step's
tokens of row i use seq_len = meta.seq_lens[i] (that row's length after the step, which is HF's
max(position_ids) + 1 for that sequence's own forward), and a token's key keeps in the KV cache the
rotation it was computed with, as HF's cache does. That equals HF for any sequence that stays on one
side of the threshold, for prompts beyond it prefilled in one step, and for a generation that grows
past it (HF's next cached forward rotates the new tokens for the new length and keeps the cached
keys, as raytp's next step does; tests/model_exec/families/test_rope_scaling.py). It differs where HF has no
counterpart or does something else: a prompt beyond the threshold prefilled in chunks rotates the
chunks that end at or below it with the short (longrope) or unscaled (dynamic) frequencies, a prefix
cache hit reuses keys rotated for another length, and HF's Phi3ForCausalLM alone drops its cache
when a generation crosses original_max_position_embeddings and re-prefills with the long factors
(raytp keeps the cached keys). vLLM instead fixes longrope's choice for the engine's life (long
factors iff max_model_len > original_max_position_embeddings) and dynamic's base at the maximum
length: consistent keys, but unlike HF for every sequence below the threshold. raytp follows HF
because HF is the correctness reference and the per-step rule needs no recomputation; HF's dynamic
rope is also stateful across calls (it keeps a grown base until a call shorter than
max_position_embeddings resets it), which raytp does not copy: each sequence is rotated as HF
rotates it in a fresh model. Dynamic rope exists for lengths past max_position_embeddings, so it lifts
the engine's context limit to max_position_embeddings x factor (`ModelConfig.max_context_len`, vLLM's
limit); the cache holds the unscaled angles and longer rows get theirs computed per step.

A model looks its step's angles up once (`angles`), and every layer applies them (`rotate_owned`)
to its queries and keys together, as one [T, q_heads + kv_heads, head_dim] view of the fused
projection: in place for float32 CPU tensors (ops/fused.py, one kernel instead of chunk, four
muls, sub, add and cat with their temporaries), a new tensor elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ops import fused, fused_cuda

if TYPE_CHECKING:
    from ops.attention.base import AttentionMetadata

# types whose frequencies depend on the sequence's length (see the module docstring)
LENGTH_DEPENDENT_ROPE_TYPES = ("longrope", "dynamic")


def _exponents(dim: int) -> torch.Tensor:
    """arange(0, dim, 2) / dim in float32, as every HF rope init writes it."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def rope_parameters(
    dim: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None,
    max_position_embeddings: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2] in float32, attention factor) for `dim` rotated features.

    HF's `ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)`; `seq_len` matters only to longrope
    (long factors above original_max_position_embeddings) and dynamic (base rescaled above
    max_position_embeddings).
    """
    rope_type = "default" if rope_scaling is None else str(rope_scaling["rope_type"])
    inv_freq = 1.0 / (base ** _exponents(dim))
    if rope_type == "default":
        return inv_freq, 1.0
    assert rope_scaling is not None
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, rope_scaling, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(dim, base, rope_scaling, max_position_embeddings, seq_len)
    if rope_type == "dynamic":
        return _dynamic_inv_freq(dim, base, float(rope_scaling["factor"]), max_position_embeddings, seq_len), 1.0
    raise ValueError(f"unsupported rope type {rope_type!r}")


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: Mapping[str, Any] | None, max_position_embeddings: int | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 for the given rope type, at its initial length."""
    return rope_parameters(head_dim, base, rope_scaling, max_position_embeddings or 0)[0]


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: Mapping[str, Any]) -> torch.Tensor:
    factor = float(rope_scaling["factor"])
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


def _yarn(dim: int, base: float, p: Mapping[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """HF's `_compute_yarn_parameters`: frequencies interpolated by `factor` below the correction range,
    kept above it, ramped linearly between; cos/sin scaled by the attention factor (mscale)."""
    original = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    factor = max_pos / original if factor is None else float(factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(
    dim: int, base: float, p: Mapping[str, Any], max_pos: int, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """HF's `_compute_longrope_parameters`: per-frequency divisors, the long ones iff seq_len exceeds
    original_max_position_embeddings; the attention factor defaults to sqrt(1 + ln f / ln original)
    with f = factor, or max_position_embeddings / original where the config gives no factor (Phi-3)."""
    original = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    factor = max_pos / original if factor is None else float(factor)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext_factors = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=torch.float32)
    if ext_factors.shape != (dim // 2,):
        raise ValueError(
            f"rope_scaling {'long' if long else 'short'}_factor has {ext_factors.numel()} entries, "
            f"the rotary dimension {dim} needs {dim // 2}"
        )
    return 1.0 / (ext_factors * base ** _exponents(dim)), float(attention_factor)


def _dynamic_inv_freq(dim: int, base: float, factor: float, max_pos: int, seq_len: int | None) -> torch.Tensor:
    """HF's `_compute_dynamic_ntk_parameters`: at init (no seq_len) in Python floats, when a forward grows
    past max_position_embeddings in float32 tensor arithmetic (HF passes that seq_len as a tensor)."""
    exponent = dim / (dim - 2)
    if seq_len is None or seq_len <= max_pos:
        return 1.0 / ((base * ((factor * max_pos / max_pos) - (factor - 1)) ** exponent) ** _exponents(dim))
    length = torch.tensor(seq_len, dtype=torch.int64)
    return 1.0 / ((base * ((factor * length / max_pos) - (factor - 1)) ** exponent) ** _exponents(dim))


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float) -> torch.Tensor:
    """[len(positions), rotary_dim]: cos | sin in float32, each times the attention factor (HF's order)."""
    freqs = torch.outer(positions.to(torch.float32), inv_freq.to(positions.device))
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1)


@dataclass(frozen=True)
class RopeAngles:
    """One step's rotary angles, looked up once and shared by every layer."""

    cos: torch.Tensor  # [T, 1, rotary_dim // 2] in the activations' dtype
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, heads, head_dim] and k [T, kv_heads, head_dim] at positions [T].

    One instance is shared by all layers of a model. `rotary_dim` (default head_dim) features of each
    head are rotated, the rest pass through.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: Mapping[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 != 0 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary dimension must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.rope_scaling = dict(rope_scaling) if rope_scaling is not None else None
        self.rope_type = "default" if rope_scaling is None else str(rope_scaling["rope_type"])
        self.length_dependent = self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES
        positions = torch.arange(max_position_embeddings, dtype=torch.float32)
        rows = [_cos_sin(positions, *self._parameters_at(None))]
        if self.rope_type == "longrope":  # rows [max_pos, 2 max_pos): the same positions, long factors
            assert self.rope_scaling is not None
            rows.append(_cos_sin(positions, *self._parameters_at(self.long_threshold + 1)))
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", torch.cat(rows), persistent=False)

    def _parameters_at(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        return rope_parameters(self.rotary_dim, self.base, self.rope_scaling, self.max_position_embeddings, seq_len)

    @property
    def long_threshold(self) -> int:
        """The sequence length above which a length-dependent type changes its frequencies."""
        assert self.rope_scaling is not None
        if self.rope_type == "longrope":
            return int(self.rope_scaling["original_max_position_embeddings"])
        return self.max_position_embeddings  # dynamic: HF's original_max_seq_len

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin, each [T, rotary_dim // 2]; `seq_lens` [T]: each token's sequence length
        after this step (HF's seq_len; the length-dependent types need it, the others refuse it)."""
        if not self.length_dependent:
            if seq_lens is not None:
                raise ValueError(f"rope type {self.rope_type!r} does not depend on the sequence length")
            cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
            return cos, sin
        if seq_lens is None:
            raise ValueError(f"rope type {self.rope_type!r} needs each token's sequence length")
        long = seq_lens > self.long_threshold
        if self.rope_type == "longrope":
            cos, sin = self.cos_sin_cache[positions + long * self.max_position_embeddings].chunk(2, dim=-1)
            return cos, sin
        # dynamic: rows past max_position_embeddings get their own base, computed here (positions there lie
        # beyond the cache, which holds the unscaled frequencies for every shorter row)
        cached = torch.where(long, 0, positions)
        table = self.cos_sin_cache[cached]
        if bool(long.any()):
            for length in torch.unique(seq_lens[long]).tolist():
                at = seq_lens == length
                table[at] = _cos_sin(positions[at], *self._parameters_at(int(length))).to(table.device)
        cos, sin = table.chunk(2, dim=-1)
        return cos, sin

    def angles(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata | None = None) -> RopeAngles:
        """The step's angles; `meta` (the step's rows) is needed by the length-dependent types only."""
        seq_lens = None
        if self.length_dependent:
            if meta is None:
                raise ValueError(f"rope type {self.rope_type!r} needs the step's attention metadata")
            seq_lens = token_seq_lens(meta).to(positions.device)
        cos, sin = self.cos_sin(positions, seq_lens)
        return RopeAngles(cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype))

    @staticmethod
    def rotate(angles: RopeAngles, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] (any heads: q, k, or both side by side) rotated; a new tensor.

        The torch reference that `rotate_owned`'s kernel matches bit for bit."""
        rotary_dim = 2 * angles.cos.shape[-1]
        if rotary_dim == x.shape[-1]:
            return _rotate(x, angles.cos, angles.sin)
        return torch.cat((_rotate(x[..., :rotary_dim], angles.cos, angles.sin), x[..., rotary_dim:]), dim=-1)

    @staticmethod
    def rotate_owned(angles: RopeAngles, x: torch.Tensor) -> torch.Tensor:
        """`rotate` for an x the caller gives up: rotated in place where the fused kernel applies
        (float32 on the CPU; x may be a strided view, e.g. the q|k part of a fused projection, and
        keeps its strides; under partial rotary only the rotated features are touched), else a new
        tensor. Callers use only the result."""
        rotated = x[..., : 2 * angles.cos.shape[-1]]
        if fused_cuda.applies(rotated, angles.cos, angles.sin):  # CUDA: one Triton kernel, in place
            fused_cuda.kernels().rotate_half_(rotated, angles.cos, angles.sin)
            return x
        if fused.applies(rotated, angles.cos, angles.sin):
            fused.rotate_half_rope_(rotated, angles.cos, angles.sin)
            return x
        return RotaryEmbedding.rotate(angles, x)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = self.angles(positions, q.dtype, meta)
        return self.rotate(angles, q), self.rotate(angles, k)


def token_seq_lens(meta: AttentionMetadata) -> torch.Tensor:
    """[T] int64: for every token of the step, its row's length after the step (meta.seq_lens)."""
    counts = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    return torch.repeat_interleave(meta.seq_lens.long(), counts)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
