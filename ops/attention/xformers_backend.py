"""Paged attention through xformers' memory-efficient kernels (CUDA only; `pip install xformers>=0.0.28`).

Each step gathers every row's cached keys/values (through the block table) into one packed
`[sum(seq_lens), kv_heads, head_dim]` tensor and runs ONE `memory_efficient_attention_forward`
over the whole batch with a `BlockDiagonalCausalFromBottomRightMask`: row r's queries see only
row r's keys, and query i sits at position seq_len - query_len + i. Decodes and prefill chunks
go through the same call. GQA uses xformers' 5-D `[B, M, G, H, K]` layout with K/V expanded
(stride 0) over the query heads of a group, so nothing is repeated in memory.

This works with any block size (xformers' own paged masks need large pages on most kernels).
Building the mask needs the per-row lengths on the host: that one device->host read happens
once per step, not per layer, because the step plan is cached on the identity of the step's
AttentionMetadata (the model runner builds a fresh one each step and never mutates it).
xformers is imported in `__init__`, never at module import, so CPU machines can import this file.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ops.attention.base import AttentionBackend, AttentionMetadata
from ops.cache_ops import write_to_paged_cache


@dataclass(frozen=True)
class _StepPlan:
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64: cache slot of every key, rows packed in order
    attn_bias: Any  # xformers BlockDiagonalCausalFromBottomRightMask over (query_lens, seq_lens)


_plans = threading.local()  # the last step's plan per thread: (weakref to its metadata, plan)


def _step_plan(meta: AttentionMetadata, block_size: int, fmha: Any) -> _StepPlan:
    cached = getattr(_plans, "last", None)
    if cached is not None and cached[0]() is meta and cached[2] == block_size:
        plan: _StepPlan = cached[1]
        return plan
    device = meta.seq_lens.device
    seq_lens = meta.seq_lens.to(torch.long)
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).to(torch.long)
    q_lens_host, seq_lens_host = torch.stack([q_lens, seq_lens]).tolist()  # the one host read of the step
    total = sum(seq_lens_host)
    rows = torch.arange(meta.num_seqs, device=device)
    row_of_key = torch.repeat_interleave(rows, seq_lens, output_size=total)
    key_starts = torch.cumsum(seq_lens, 0) - seq_lens
    pos = torch.arange(total, device=device) - key_starts[row_of_key]
    block = meta.block_tables[row_of_key, pos // block_size].to(torch.long)
    kv_slots = block * block_size + pos % block_size
    bias = fmha.attn_bias.BlockDiagonalMask.from_seqlens(
        q_lens_host, seq_lens_host
    ).make_causal_from_bottomright()
    plan = _StepPlan(kv_slots=kv_slots, attn_bias=bias)
    _plans.last = (weakref.ref(meta), plan, block_size)
    return plan


class XFormersBackend(AttentionBackend):
    name = "xformers"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(
            num_heads, num_kv_heads, head_dim, scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
        )
        try:
            from xformers.ops import fmha
        except ImportError as exc:
            raise ValueError(
                "attention_backend='xformers' needs the xformers package "
                f"(pip install xformers>=0.0.28): {exc}"
            ) from exc
        self._fmha: Any = fmha
        self._group = num_heads // num_kv_heads

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_to_paged_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        plan = _step_plan(meta, key_cache.shape[1], self._fmha)
        num_tokens, hkv, d = query.shape[0], self.num_kv_heads, self.head_dim
        k = key_cache.view(-1, hkv, d).index_select(0, plan.kv_slots)  # [S, Hkv, D]
        v = value_cache.view(-1, hkv, d).index_select(0, plan.kv_slots)
        num_keys = k.shape[0]
        if self._group == 1:
            q = query.reshape(1, num_tokens, hkv, d)
            k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
        else:  # [B=1, M, G=kv heads, H=query heads per group, K]
            q = query.reshape(1, num_tokens, hkv, self._group, d)
            k4 = k.view(1, num_keys, hkv, 1, d).expand(1, num_keys, hkv, self._group, d)
            v4 = v.view(1, num_keys, hkv, 1, d).expand(1, num_keys, hkv, self._group, d)
        out = self._fmha.memory_efficient_attention_forward(
            q, k4, v4, attn_bias=plan.attn_bias, scale=self.scale
        )
        return out.reshape(num_tokens, self.num_heads, d)
