"""Paged KV bookkeeping in plain Python: block pool, prefix-cache keys, block manager. No tensors (the KV
tensors live with the model on the workers: `model_exec.cache_engine`)."""

from kv.block_manager import AllocStatus, BlockManager
from kv.block_pool import NoFreeBlocksError

__all__ = ["AllocStatus", "BlockManager", "NoFreeBlocksError"]
