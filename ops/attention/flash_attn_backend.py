"""Paged attention through flash-attn's block-table kernels (CUDA only; `pip install flash-attn>=2.6`).

flash-attn reads the paged cache `[num_blocks, block_size, kv_heads, head_dim]` in place through
`block_table`, so nothing is gathered:
- a pure-decode step calls `flash_attn_with_kvcache` (split-KV decode kernel);
- any step with a prefill chunk calls `flash_attn_varlen_func` over the whole packed batch, with
  `cu_seqlens_k` the running sum of `seq_lens` and bottom-right causal alignment, which is exactly
  "query i of a row sits at seq_len - query_len + i".

Sliding window w and logit soft-cap c go to both calls as flash-attn's `window_size=(w - 1, 0)`
(query at p sees keys p - (w - 1) ..= p, bottom-right aligned like the causal mask) and `softcap=c`;
the kernels then skip the key blocks wholly outside the window. Both keywords exist from
flash-attn 2.6 on (softcap came last), so a layer that uses either checks the installed version.

Constraints (checked, with a clear error): fp16/bf16 only, and upstream flash-attn 2.x accepts a
paged KV cache only when block_size is a multiple of 256 ("Paged KV cache block size must be
divisible by 256"). With the default block_size 16, use `xformers` or `torch` (`auto` does).
flash-attn is imported in `__init__`, never at module import, so CPU machines can import this file.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F

from ops.attention import FLASH_ATTN_BLOCK_MULTIPLE
from ops.attention.base import AttentionBackend, AttentionMetadata, StepKV


def check_flash_attn_block_size(block_size: int) -> None:
    """Raise ValueError unless flash-attn can read a paged cache with this block size."""
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
        raise ValueError(
            f"attention_backend='flash_attn' needs block_size to be a multiple of "
            f"{FLASH_ATTN_BLOCK_MULTIPLE} (flash-attn's paged-KV kernels); got block_size={block_size}. "
            f"Use block_size={FLASH_ATTN_BLOCK_MULTIPLE} or attention_backend='xformers'/'torch'."
        )


def _major_minor(version: str) -> tuple[int, int]:
    """(2, 6) from "2.6.3" or "2.6.0.post1"; (0, 0) when it does not parse."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    # Capturable (its row in registry.py): the decode road is index_copy_ + flash_attn_with_kvcache, both
    # sync-free with tensor-only inputs (vLLM captures the same call); max_seq_len is not read there.

    def _prepare(self) -> None:
        flash_attn = self._import("flash_attn")
        if self.head_dim > 256 or self.head_dim % 8 != 0:
            raise ValueError(f"flash-attn supports head_dim <= 256 and a multiple of 8; got {self.head_dim}.")
        self._varlen: Any = flash_attn.flash_attn_varlen_func
        self._with_kvcache: Any = flash_attn.flash_attn_with_kvcache
        # Passed only when set, so a layer without either option runs on any flash-attn 2.x.
        self._options: dict[str, Any] = {}
        if self.sliding_window is not None:
            self._options["window_size"] = (self.sliding_window - 1, 0)
        if self.logits_soft_cap is not None:
            self._options["softcap"] = float(self.logits_soft_cap)
        version = str(getattr(flash_attn, "__version__", "0"))
        if self._options and _major_minor(version) < (2, 6):
            raise ValueError(
                f"attention_backend='flash_attn' needs flash-attn>=2.6 for sliding_window / logits_soft_cap; "
                f"found {version}."
            )

    def _check(self, query: torch.Tensor, kv: StepKV) -> None:
        check_flash_attn_block_size(kv.key_cache.shape[1])
        self._check_dtypes(query, kv)

    def _attend(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata) -> torch.Tensor:
        if meta.max_query_len == 1:  # pure decode: the cache already holds the new token
            out = self._with_kvcache(
                query.unsqueeze(1),  # [B, 1, Hq, D]
                kv.key_cache,
                kv.value_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=self.scale,
                causal=True,
                **self._options,
            )
            return out.squeeze(1)
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, dim=0, dtype=torch.int32), (1, 0))
        return self._varlen(
            query,
            kv.key_cache,
            kv.value_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=meta.block_tables,
            **self._options,
        )
