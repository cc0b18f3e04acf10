"""Physical blocks of one memory (the device's KV cache or the CPU swap space), as plain integers.

A pool knows reference counts and, when prefix caching is on, which blocks hold KV under which content key. It
does not know about sequences: the block manager owns the block tables and keeps the counts equal to them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

from kv.prefix_cache import BlockHash


class NoFreeBlocksError(RuntimeError):
    """An allocation found no free block; callers ask the `can_*` methods first, so this is a caller bug."""


class BlockPool:
    """Blocks 0..num_blocks-1.

    Invariant: every block is in exactly one state, and the three sets partition the pool:
      free       ref == 0, no key,  in `_free`
      used       ref >  0, with or without a key (with a key it is hittable by prefix lookups)
      evictable  ref == 0, with a key, in `_evictor` (least recently released first)
    A key maps to at most one block and a block has at most one key (`_hash_of` and `_block_of` are inverse).

    Eviction decision: `allocate` takes a never-cached free block while one exists and evicts the least
    recently released cached block only when none remains, so cached prefixes survive as long as possible.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictor: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictor)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictor)

    @property
    def num_cached(self) -> int:
        """Blocks holding a content key (used or evictable)."""
        return len(self._hash_of)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self) -> int:
        """Take a block for exclusive use (ref count 1); an evicted block loses its key."""
        if self._free:
            block = self._free.popleft()
        elif self._evictor:
            block, _ = self._evictor.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        self._ref[block] = 1
        return block

    def incref(self, block: int, n: int = 1) -> None:
        """Add `n` references; a cached block at ref 0 is revived (leaves the evictor)."""
        if self._ref[block] == 0:
            assert block in self._evictor, f"block {block} is free; allocate it instead"
            del self._evictor[block]
        self._ref[block] += n

    def decref(self, block: int, n: int = 1) -> None:
        """Drop `n` references; at ref 0 a cached block becomes evictable (most recent), others free."""
        assert self._ref[block] >= n, f"block {block} released more often than referenced"
        self._ref[block] -= n
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._evictor[block] = None
            else:
                self._free.append(block)

    def lookup(self, key: BlockHash) -> int | None:
        """The block holding KV for `key` (used or evictable), if any."""
        return self._block_of.get(key)

    def register(self, block: int, key: BlockHash) -> None:
        """Make a used block, whose KV is computed, hittable under `key`.

        When another block already holds `key` (two sequences computed the same content independently), the
        first stays the cached one and `block` stays uncached: one key, one block.
        """
        assert self._ref[block] > 0, f"only a used block can be registered, block {block} has ref 0"
        current = self._hash_of.get(block)
        if current is not None:
            assert current == key, f"block {block} is cached under another key"
            return
        if key not in self._block_of:
            self._hash_of[block] = key
            self._block_of[key] = block

    def reset_cache(self) -> bool:
        """Forget every key. Refused (False, nothing changes) while any block is used, as vLLM does."""
        if self.num_used:
            return False
        self._free.extend(self._evictor)
        self._evictor.clear()
        self._hash_of.clear()
        self._block_of.clear()
        return True

    def check_invariants(self, expected_refs: Counter[int]) -> None:
        """Assert the state partition, the key maps, and ref counts equal to `expected_refs` (from tables)."""
        free, evictable = set(self._free), set(self._evictor)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and evictable"
        for block in range(self.num_blocks):
            ref = self._ref[block]
            assert ref == expected_refs.get(block, 0), (
                f"block {block}: ref count {ref}, but {expected_refs.get(block, 0)} table entries point to it"
            )
            if ref > 0:
                assert block not in free and block not in evictable, f"used block {block} is also free"
            elif block in self._hash_of:
                assert block in evictable, f"cached block {block} at ref 0 is not evictable"
            else:
                assert block in free, f"block {block} at ref 0 is lost (neither free nor evictable)"
        assert set(expected_refs) <= set(range(self.num_blocks)), "a table points outside the pool"
        used = sum(1 for r in self._ref if r > 0)
        assert len(free) + len(evictable) + used == self.num_blocks
        assert len(self._hash_of) == len(self._block_of)
        for block, key in self._hash_of.items():
            assert self._block_of.get(key) == block, f"key maps of block {block} disagree"
