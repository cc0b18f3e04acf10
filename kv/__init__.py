"""Paged KV bookkeeping. The package root stays torch-free; import `kv.cache_engine` for tensors."""

from kv.block_manager import AllocStatus, BlockManager
from kv.block_pool import NoFreeBlocksError

__all__ = ["AllocStatus", "BlockManager", "NoFreeBlocksError"]
