"""KV-cache tensor ops: write new tokens through a slot mapping, copy and swap whole blocks.

All ops work on the paged layout `[num_blocks, block_size, num_kv_heads, head_dim]` and are
vectorised: one index op per tensor (per layer for the block moves), never a Python loop over
tokens or blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ops.attention import cpu_kernels

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache) of one layer


def write_to_paged_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,  # same shape as key_cache
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset
) -> None:
    """Scatter each token's key/value into its cache slot (in place).

    fp32 on the CPU: one C++ call for both (`csrc/kv_write.cpp`), where the two index_copy_ cost ~35 us
    each per layer for a decode step's few KB."""
    if _cpu_kernel_applies(key, value, key_cache, value_cache, slot_mapping):
        torch.ops.raytp_cpu.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    # A flat [num_slots, H, D] view turns the scatter into one index_copy_ per tensor.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _cpu_kernel_applies(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> bool:
    for cache in (key_cache, value_cache):
        if not (cache.is_cpu and cache.dtype == torch.float32 and cache.is_contiguous()):
            return False
    if not key.dtype == value.dtype == torch.float32:
        return False
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        return False
    # each token's heads side by side, as in a view into the fused QKV projection
    for t in (key, value):
        if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            return False
    return cpu_kernels.load_error() is None


def _split_pairs(pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return src, dst


def copy_blocks(caches: Sequence[KVCache], pairs: Sequence[tuple[int, int]]) -> None:
    """Copy block `src` onto block `dst` for every (src, dst) pair, in every layer.

    Sources are read before any destination is written, so a block may be both a source and a
    destination within one call. Destinations must be distinct.
    """
    if not pairs or not caches:
        return
    src, dst = _split_pairs(pairs)
    device = caches[0][0].device
    src, dst = src.to(device), dst.to(device)
    for key_cache, value_cache in caches:
        key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
        value_cache.index_copy_(0, dst, value_cache.index_select(0, src))


def swap_blocks(
    src_caches: Sequence[KVCache], dst_caches: Sequence[KVCache], pairs: Sequence[tuple[int, int]]
) -> None:
    """Copy block `src` of `src_caches` to block `dst` of `dst_caches` (typically across devices).

    Per layer: gather the source blocks into one contiguous tensor, move it in one transfer,
    scatter it into the destination.
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError(
            f"swap_blocks: {len(src_caches)} source layers but {len(dst_caches)} destination layers."
        )
    if not pairs or not src_caches:
        return
    src, dst = _split_pairs(pairs)
    src = src.to(src_caches[0][0].device)
    dst = dst.to(dst_caches[0][0].device)
    for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches, strict=True):
        dst_k.index_copy_(0, dst, src_k.index_select(0, src).to(dst_k.device))
        dst_v.index_copy_(0, dst, src_v.index_select(0, src).to(dst_v.device))
