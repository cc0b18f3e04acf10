"""Paged attention through xformers' memory-efficient kernels (CUDA only; `pip install xformers>=0.0.28`).

Each step gathers every row's cached keys/values (through the block table) into one packed
`[sum(seq_lens), kv_heads, head_dim]` tensor and runs ONE `memory_efficient_attention_forward`
over the whole batch with a `BlockDiagonalCausalFromBottomRightMask`: row r's queries see only
row r's keys, and query i sits at position seq_len - query_len + i. Decodes and prefill chunks
go through the same call. GQA uses xformers' 5-D `[B, M, G, H, K]` layout with K/V expanded
(stride 0) over the query heads of a group, so nothing is repeated in memory.

A sliding-window layer (window w) gathers only each row's keys from its first query's window on
(positions >= seq_len - query_len - w + 1: never anything a query of the row may attend) and uses
`make_local_attention_from_bottomright(w)`: query at p sees keys p - w < k <= p, still bottom-right
aligned, since only leading keys were dropped. xformers' kernels have no logit soft-capping, so
this backend refuses `logits_soft_cap` (the base class's error); `torch` implements it.

This works with any block size (xformers' own paged masks need large pages on most kernels).
Building the mask needs the per-row lengths on the host: that one device->host read happens
once per step, not per layer, because the step's plans (one per window size) are cached on the
identity of the step's AttentionMetadata (the model runner builds a fresh one each step and never
mutates it).
xformers is imported in `__init__`, never at module import, so CPU machines can import this file.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ops.attention.base import AttentionBackend, AttentionMetadata, StepKV


@dataclass(frozen=True)
class _StepPlan:
    kv_slots: torch.Tensor  # [total keys] int64: cache slot of every key read, rows packed in order
    attn_bias: Any  # xformers block-diagonal bottom-right causal (or local) mask over (query_lens, key counts)


@dataclass
class _StepPlans:
    meta: weakref.ref[AttentionMetadata]  # the step these plans belong to
    lens: tuple[list[int], list[int]]  # (query_lens, seq_lens) on the host: the step's one device->host read
    by_layout: dict[tuple[int, int | None], _StepPlan]  # keyed by (block_size, sliding_window)


_plans = threading.local()  # the last step's plans per thread (`_StepPlans`)


def _step_plan(meta: AttentionMetadata, block_size: int, window: int | None, fmha: Any) -> _StepPlan:
    plans: _StepPlans | None = getattr(_plans, "last", None)
    if plans is None or plans.meta() is not meta:
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        q_lens_host, seq_lens_host = torch.stack([q_lens, meta.seq_lens]).tolist()
        plans = _StepPlans(weakref.ref(meta), (q_lens_host, seq_lens_host), {})
        _plans.last = plans
    plan = plans.by_layout.get((block_size, window))
    if plan is not None:
        return plan
    q_lens_host, seq_lens_host = plans.lens
    # Keys from the first one any query of the row may attend: 0, or the first query's window.
    lens = zip(q_lens_host, seq_lens_host, strict=True)
    firsts = [0 if window is None else max(0, s - q - window + 1) for q, s in lens]
    counts = [s - f for s, f in zip(seq_lens_host, firsts, strict=True)]
    device = meta.seq_lens.device
    total = sum(counts)
    counts_t = torch.tensor(counts, dtype=torch.long, device=device)
    row_of_key = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), counts_t, output_size=total)
    key_starts = torch.cumsum(counts_t, 0) - counts_t
    first_t = torch.tensor(firsts, dtype=torch.long, device=device)
    pos = torch.arange(total, device=device) - key_starts[row_of_key] + first_t[row_of_key]
    block = meta.block_tables[row_of_key, pos // block_size].to(torch.long)
    kv_slots = block * block_size + pos % block_size
    mask = fmha.attn_bias.BlockDiagonalMask.from_seqlens(q_lens_host, counts)
    bias = mask.make_causal_from_bottomright() if window is None else mask.make_local_attention_from_bottomright(window)
    plan = _StepPlan(kv_slots=kv_slots, attn_bias=bias)
    plans.by_layout[(block_size, window)] = plan
    return plan


class XFormersBackend(AttentionBackend):
    name = "xformers"

    def _prepare(self) -> None:
        self._fmha: Any = self._import("xformers.ops").fmha
        self._group = self.num_heads // self.num_kv_heads

    def _attend(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata) -> torch.Tensor:
        plan = _step_plan(meta, kv.key_cache.shape[1], self.sliding_window, self._fmha)
        num_tokens, hkv, d = query.shape[0], self.num_kv_heads, self.head_dim
        k = kv.key_cache.view(-1, hkv, d).index_select(0, plan.kv_slots)  # [S, Hkv, D]
        v = kv.value_cache.view(-1, hkv, d).index_select(0, plan.kv_slots)
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
