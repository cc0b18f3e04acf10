"""The paged-KV block manager: maps each sequence's logical blocks to physical device (or CPU swap) blocks.

Allocation is V0 style: a sequence gets blocks for its whole prompt when admitted, and chunked prefill then
computes over blocks it already holds; decoding grows the table block by block through `append_slots`.

Contract with the cache engine: the (src, dst) pairs returned in one scheduler step are valid when applied as
swap-outs, then swap-ins, then copy-on-write copies, all before that step's forward pass. That holds because
the scheduler calls swap_out (preemption) before swap_in (resumption) within a step, and a block released by
a swap-out is only ever a destination afterwards, never a source.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kv.block_pool import BlockPool, NoFreeBlocksError
from kv.prefix_cache import BlockHash, hash_full_blocks, match_prefix

_NO_BLOCKS: frozenset[int] = frozenset()  # _growth's answer when nothing is shared (no set built per decode)
_NO_PENDING: Mapping[int, int] = {}  # append_slots: no earlier appends in its batch (never written)


class AllocStatus(enum.Enum):
    """Admission answer. Decision (as vLLM V0): NEVER already when the request would dip into the watermark
    of an otherwise empty pool, since LATER would then be a promise that can never be kept."""

    OK = enum.auto()  # fits now and leaves at least the watermark free
    LATER = enum.auto()  # fits, but not now
    NEVER = enum.auto()  # does not fit even in an empty pool (keeping the watermark free)


@dataclass
class _SeqBlocks:
    table: list[int]  # logical block i -> physical block, on the device or (when swapped) on the CPU
    on_cpu: bool = False
    hashes: list[BlockHash] = field(default_factory=list)  # content keys of the leading full blocks seen
    num_registered: int = 0  # leading blocks already offered to the prefix cache (prefix caching only)
    salt: BlockHash | None = None  # root of `hashes`' chain (e.g. the LoRA adapter's identity); None: unsalted


class BlockManager:
    """Block tables over a device pool and a CPU swap pool; pure Python, no tensors.

    Invariants (checked by `check_invariants`): a block's ref count equals the number of table entries
    pointing to it among sequences on that memory; device blocks partition into free / used /
    evictable-cached; a block gets a content key only after its KV is computed; `append_slots` never leaves a
    block with ref > 1 inside a range about to be written (it copies on write first).
    """

    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if num_device_blocks <= 0:
            raise ValueError(f"num_device_blocks must be > 0, got {num_device_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._device = BlockPool(num_device_blocks)
        self._cpu = BlockPool(num_cpu_blocks)
        self._seqs: dict[int, _SeqBlocks] = {}
        # Metrics, in tokens: prompt tokens looked up, and leading tokens found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- admission ---

    def can_allocate(
        self, token_ids: Sequence[int], use_prefix_cache: bool = True, salt: BlockHash | None = None
    ) -> AllocStatus:
        needed = self._blocks_for(len(token_ids))
        _, hits = self._match_prefix(token_ids, use_prefix_cache, salt)
        return self._admission(needed, self._cost_of(needed, hits))

    def allocate(
        self, seq_id: int, token_ids: Sequence[int], use_prefix_cache: bool = True, salt: BlockHash | None = None
    ) -> int:
        """Give `seq_id` blocks for all of `token_ids`; returns how many leading tokens are already computed
        (whole cached blocks, never the block of the last token: see `match_prefix`). With
        `use_prefix_cache=False` nothing is reused (every token is computed), but the blocks still enter
        the cache once computed. `salt` roots the sequence's key chain (`kv.prefix_cache.salt_of`): only
        sequences with the same salt share cached blocks; the sequence's forks inherit it."""
        if seq_id in self._seqs:
            raise ValueError(f"seq {seq_id} already has blocks")
        if not token_ids:
            raise ValueError("cannot allocate an empty sequence")
        needed = self._blocks_for(len(token_ids))
        hashes, hits = self._match_prefix(token_ids, use_prefix_cache, salt)
        if self._cost_of(needed, hits) > self._device.num_free:
            raise NoFreeBlocksError(f"seq {seq_id} needs {needed} blocks; check can_allocate first")
        for block in hits:  # revive hits before allocating, so allocation cannot evict them
            self._device.incref(block)
        table = hits + [self._device.allocate() for _ in range(needed - len(hits))]
        self._seqs[seq_id] = _SeqBlocks(table, hashes=hashes, num_registered=len(hits), salt=salt)
        num_computed = len(hits) * self.block_size
        if self.enable_prefix_caching and use_prefix_cache:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += num_computed
        return num_computed

    # --- growth ---

    def can_append_slots(self, appends: Sequence[tuple[int, int, int]]) -> bool:
        """Whether every `(seq_id, num_total_tokens, num_computed_tokens)`, the arguments of `append_slots` in
        the order they will be made, fits in the free device blocks, copy-on-write copies included."""
        pending: Mapping[int, int] = _NO_PENDING  # references the earlier appends give up by copying
        needed = 0
        for seq_id, num_total, num_computed in appends:
            cow, new = self._growth(self._device_seq(seq_id), num_total, num_computed, pending)
            if cow:
                pending = Counter(pending)  # (built only once a copy shows up: a decode batch rarely has one)
                pending.update(cow)
                needed += len(cow)
            needed += new
        return needed <= self._device.num_free

    def append_slots(self, seq_id: int, num_total_tokens: int, num_computed_tokens: int) -> list[tuple[int, int]]:
        """Cover `num_total_tokens` slots; positions [num_computed_tokens, num_total_tokens) get written.

        Every shared block in that range is replaced by a fresh one (copy-on-write); the returned (src, dst)
        pairs must be copied before the forward pass. A sibling left alone on the original then writes it in
        place, without a second copy.
        """
        copies = self.try_append_slots(seq_id, num_total_tokens, num_computed_tokens)
        if copies is None:
            raise NoFreeBlocksError(f"seq {seq_id} needs more blocks than are free; ask can_append_slots")
        return copies

    def try_append_slots(
        self, seq_id: int, num_total_tokens: int, num_computed_tokens: int
    ) -> list[tuple[int, int]] | None:
        """`append_slots` when `can_append_slots([(seq_id, num_total_tokens, num_computed_tokens)])` holds, in one
        pass (the scheduler's steady decode row: one growth computed instead of two); None, changing nothing,
        when the free device blocks cannot cover it."""
        seq = self._device_seq(seq_id)
        cow, new = self._growth(seq, num_total_tokens, num_computed_tokens, _NO_PENDING)
        if len(cow) + new > self._device.num_free:
            return None
        if not cow:  # the common case (a decode in a block of its own): no copy to look for
            if new:
                seq.table.extend(self._device.allocate() for _ in range(new))
            return []
        copies: list[tuple[int, int]] = []
        first = num_computed_tokens // self.block_size
        for i in range(first, len(seq.table)):
            src = seq.table[i]
            if src in cow:
                dst = self._device.allocate()
                self._device.decref(src)  # stays >= 1: the siblings still hold it
                seq.table[i] = dst
                copies.append((src, dst))
        seq.table.extend(self._device.allocate() for _ in range(new))
        return copies

    def blocks_needed(self, seq_id: int, num_total_tokens: int) -> int:
        """Blocks `append_slots(seq_id, num_total_tokens, ...)` would append (copy-on-write copies aside)."""
        return max(0, self._blocks_for(num_total_tokens) - len(self._device_seq(seq_id).table))

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots (speculative decoding's rejected lookahead).
        Those blocks hold no computed token, so none of them has a content key to drop."""
        seq = self._device_seq(seq_id)
        keep = self._blocks_for(num_tokens)
        if keep < seq.num_registered:
            raise ValueError(f"seq {seq_id}: trimming to {num_tokens} tokens would drop registered blocks")
        for block in reversed(seq.table[keep:]):
            self._device.decref(block)
        del seq.table[keep:]

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (on whichever memory the parent is)."""
        if child_seq_id in self._seqs:
            raise ValueError(f"seq {child_seq_id} already has blocks")
        parent = self._seq(parent_seq_id)
        pool = self._cpu if parent.on_cpu else self._device
        for block in parent.table:
            pool.incref(block)
        self._seqs[child_seq_id] = _SeqBlocks(
            list(parent.table), parent.on_cpu, list(parent.hashes), parent.num_registered, parent.salt
        )

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        pool = self._cpu if seq.on_cpu else self._device
        # Release the tail first: it becomes the older evictable entry, so LRU evicts a chain's end before the
        # prefix other requests are likelier to share.
        for block in reversed(seq.table):
            pool.decref(block)

    # --- prefix caching ---

    def mark_computed(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register every full block of `seq_id` lying within its first `num_computed_tokens` tokens."""
        if not self.enable_prefix_caching:
            return
        seq = self._device_seq(seq_id)
        num_full = min(num_computed_tokens // self.block_size, len(seq.table))
        seq.hashes = hash_full_blocks(token_ids, self.block_size, seq.hashes, num_full, seq.salt)
        for i in range(seq.num_registered, num_full):
            self._device.register(seq.table[i], seq.hashes[i])
        seq.num_registered = max(seq.num_registered, num_full)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content keys; refused (False) while any device block is in use."""
        return self._device.reset_cache()

    # --- swap ---

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        return len(self._distinct_blocks(seq_ids, on_cpu=False)) <= self._cpu.num_free

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move the group to the CPU; returns (device, cpu) pairs, one per distinct block."""
        return self._move(seq_ids, src=self._device, dst=self._cpu, to_cpu=True)

    def can_swap_in(self, seq_ids: Sequence[int]) -> AllocStatus:
        needed = len(self._distinct_blocks(seq_ids, on_cpu=True))
        return self._admission(needed, needed)

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Bring the group back to fresh device blocks; returns (cpu, device) pairs, sharing preserved."""
        return self._move(seq_ids, src=self._cpu, dst=self._device, to_cpu=False)

    # --- queries ---

    def get_block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).table)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: int) -> bool:
        return self._seq(seq_id).on_cpu

    @property
    def num_device_blocks(self) -> int:
        return self._device.num_blocks

    @property
    def max_allocatable_tokens(self) -> int:
        """The longest token list `can_allocate` does not answer NEVER: the pool less the watermark."""
        return (self._device.num_blocks - self.watermark_blocks) * self.block_size

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu.num_blocks

    @property
    def num_free_device_blocks(self) -> int:
        """Free plus evictable cached blocks."""
        return self._device.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu.num_free

    def usage(self) -> float:
        """Fraction of device blocks referenced by live sequences (evictable cached blocks count as free)."""
        return self._device.num_used / self._device.num_blocks

    def check_invariants(self) -> None:
        device_refs: Counter[int] = Counter()
        cpu_refs: Counter[int] = Counter()
        for seq_id, seq in self._seqs.items():
            (cpu_refs if seq.on_cpu else device_refs).update(seq.table)
            assert seq.num_registered <= len(seq.hashes), f"seq {seq_id} registered blocks it has no key for"
            assert seq.num_registered <= len(seq.table), f"seq {seq_id} registered blocks it does not hold"
        self._device.check_invariants(device_refs)
        self._cpu.check_invariants(cpu_refs)
        assert self._cpu.num_cached == 0, "CPU blocks are never cached"

    # --- internals ---

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _seq(self, seq_id: int) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"seq {seq_id} has no blocks")
        return seq

    def _device_seq(self, seq_id: int) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)  # (not through _seq: twice per decode row per step)
        if seq is None:
            raise KeyError(f"seq {seq_id} has no blocks")
        if seq.on_cpu:
            raise ValueError(f"seq {seq_id} is swapped out")
        return seq

    def _match_prefix(
        self, token_ids: Sequence[int], use_cache: bool, salt: BlockHash | None
    ) -> tuple[list[BlockHash], list[int]]:
        """(keys of the full blocks, cached blocks holding the leading ones); no hits when not `use_cache`."""
        if not self.enable_prefix_caching:
            return [], []
        if not use_cache:
            return match_prefix(token_ids, self.block_size, lambda _key: None, salt)
        return match_prefix(token_ids, self.block_size, self._device.lookup, salt)

    def _admission(self, needed: int, cost: int) -> AllocStatus:
        """`needed` blocks in all, of which `cost` come out of the free ones now."""
        if self._device.num_blocks - needed < self.watermark_blocks:
            return AllocStatus.NEVER
        if self._device.num_free - cost < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def _cost_of(self, needed: int, hits: list[int]) -> int:
        """Free blocks an allocation consumes: fresh ones, plus evictable hits that it revives."""
        revived = sum(1 for block in hits if self._device.ref_count(block) == 0)
        return needed - len(hits) + revived

    def _growth(
        self, seq: _SeqBlocks, num_total: int, num_computed: int, pending: Mapping[int, int]
    ) -> tuple[AbstractSet[int], int]:
        """Shared blocks that writing [num_computed, num_total) must copy, and how many blocks to append.

        `pending` holds references siblings give up earlier in the same batch of appends.
        """
        if not 0 <= num_computed <= num_total:
            raise ValueError(f"need 0 <= num_computed_tokens ({num_computed}) <= num_total ({num_total})")
        end = -(-num_total // self.block_size)
        new = end - len(seq.table)
        if new < 0:
            new = 0
        if num_computed == num_total:
            return _NO_BLOCKS, new
        ref_count = self._device.ref_count
        first = num_computed // self.block_size
        if end - first == 1 and first < len(seq.table):  # a decode: one block written, rarely shared
            block = seq.table[first]
            if ref_count(block) - pending.get(block, 0) <= 1:
                return _NO_BLOCKS, new
            return {block}, new
        written = seq.table[first:end]
        cow = {b for b in written if ref_count(b) - pending.get(b, 0) > 1}
        return cow, new

    def _distinct_blocks(self, seq_ids: Sequence[int], on_cpu: bool) -> Counter[int]:
        """References the group holds to each of its blocks; all its seqs must be on the named memory."""
        refs: Counter[int] = Counter()
        for seq_id in dict.fromkeys(seq_ids):
            seq = self._seq(seq_id)
            if seq.on_cpu != on_cpu:
                raise ValueError(f"seq {seq_id} is {'' if seq.on_cpu else 'not '}swapped out")
            refs.update(seq.table)
        return refs

    def _move(self, seq_ids: Sequence[int], src: BlockPool, dst: BlockPool, to_cpu: bool) -> list[tuple[int, int]]:
        """Swap a group to the other memory; a block shared within the group moves once and stays shared."""
        refs = self._distinct_blocks(seq_ids, on_cpu=not to_cpu)
        if len(refs) > dst.num_free:
            raise NoFreeBlocksError(f"moving {len(refs)} blocks; ask can_swap_{'out' if to_cpu else 'in'}")
        mapping: dict[int, int] = {}
        for block, n in refs.items():
            mapping[block] = dst.allocate()
            dst.incref(mapping[block], n - 1)  # carry the group's sharing over
        for seq_id in dict.fromkeys(seq_ids):
            seq = self._seqs[seq_id]
            for block in reversed(seq.table):  # a cached source block at ref 0 stays cached on the device
                src.decref(block)
            seq.table = [mapping[b] for b in seq.table]
            seq.on_cpu = to_cpu
            seq.num_registered = 0  # fresh blocks carry no keys; mark_computed registers them again
        return list(mapping.items())
