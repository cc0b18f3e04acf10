"""CacheEngine: one rank's KV tensors, a device pool and a CPU swap pool, and the block moves on them.

Per layer, key and value tensors of shape `[num_blocks, block_size, num_kv_heads, head_dim]`
(the layout the attention backends read). Block ids are the block manager's: device ids index
the device pool, CPU ids the swap pool.

Allocation choices:
- The device pool is zero-filled: attention reads unwritten slots of partial blocks (then masks
  them), and masked values are multiplied by zero, so they must be finite. On the CPU it sits on
  transparent huge pages where Linux offers them (`huge_pages`): every decode step streams it.
- The CPU swap pool is `torch.empty`: a swap block is only read after a swap-out wrote it whole,
  and untouched pages of an empty CPU tensor cost no memory until written. It is pinned when the
  device is CUDA, so swaps are plain DMA copies.
- `pad_block=True` adds one device block past the block manager's ids (`pad_block_id`): the padding
  rows of a CUDA-graph decode batch write and read only there (model_exec/cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_exec import huge_pages
from ops.cache_ops import KVCache, copy_blocks, swap_blocks


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pad_block: bool = False,
    ) -> None:
        for field, val in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
            ("num_device_blocks", num_device_blocks),
        ):
            if val < 1:
                raise ValueError(f"CacheEngine: {field} must be >= 1; got {val}.")
        if num_cpu_blocks < 0:
            raise ValueError(f"CacheEngine: num_cpu_blocks must be >= 0; got {num_cpu_blocks}.")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.dtype = dtype
        self.device = torch.device(device)

        # Block ids the block manager hands out are < num_device_blocks; the pad block, if any, is the next one.
        self.pad_block_id: int | None = num_device_blocks if pad_block else None
        pool_blocks = num_device_blocks + int(pad_block)
        block_shape = (block_size, num_kv_heads, head_dim)
        self._device_caches: list[KVCache] = [
            (self._zeros((pool_blocks, *block_shape)), self._zeros((pool_blocks, *block_shape)))
            for _ in range(num_layers)
        ]
        pin = self.device.type == "cuda" and num_cpu_blocks > 0
        self._cpu_caches: list[KVCache] = [
            (
                torch.empty((num_cpu_blocks, *block_shape), dtype=dtype, pin_memory=pin),
                torch.empty((num_cpu_blocks, *block_shape), dtype=dtype, pin_memory=pin),
            )
            for _ in range(num_layers)
        ]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":  # every decode step streams the pool: on huge pages where Linux has them
            return huge_pages.zeros(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def device_caches(self) -> list[KVCache]:
        """Per layer (key_cache, value_cache) on the device; what the model's attention reads and writes."""
        return self._device_caches

    @property
    def cpu_caches(self) -> list[KVCache]:
        """Per layer (key_cache, value_cache) of the CPU swap pool."""
        return self._cpu_caches

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy CPU blocks to device blocks; pairs are (cpu block, device block)."""
        self._check(pairs, self.num_cpu_blocks, self.num_device_blocks, "swap_in")
        swap_blocks(self._cpu_caches, self._device_caches, pairs)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks; pairs are (device block, cpu block)."""
        self._check(pairs, self.num_device_blocks, self.num_cpu_blocks, "swap_out")
        swap_blocks(self._device_caches, self._cpu_caches, pairs)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks onto device blocks (copy-on-write); pairs are (src, dst)."""
        self._check(pairs, self.num_device_blocks, self.num_device_blocks, "copy")
        copy_blocks(self._device_caches, pairs)

    @staticmethod
    def _check(pairs: Sequence[tuple[int, int]], num_src: int, num_dst: int, op: str) -> None:
        # Out-of-range ids would index_copy_ out of bounds (a device-side assert on CUDA).
        for src, dst in pairs:
            if not (0 <= src < num_src and 0 <= dst < num_dst):
                raise ValueError(
                    f"CacheEngine.{op}: block pair ({src}, {dst}) out of range "
                    f"(source pool has {num_src} blocks, destination pool {num_dst})."
                )

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block id costs across all layers, keys and values."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size

    @staticmethod
    def num_blocks_for_budget(
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in `budget_bytes` (0 if not even one)."""
        per_block = CacheEngine.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        return max(budget_bytes, 0) // per_block
