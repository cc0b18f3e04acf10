"""Unit tests for the block manager: admission, growth with copy-on-write, prefix caching, eviction, swap."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kv import AllocStatus, BlockManager, NoFreeBlocksError

BS = 4


def make(num_device: int = 8, num_cpu: int = 8, watermark: float = 0, caching: bool = False) -> BlockManager:
    return BlockManager(BS, num_device, num_cpu, watermark=watermark, enable_prefix_caching=caching)


def test_package_root_imports_no_torch() -> None:
    code = "import sys, kv; assert 'torch' not in sys.modules, 'kv imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- admission ---


def test_can_allocate_ok_later_never() -> None:
    bm = make(num_device=4)
    assert bm.can_allocate(list(range(16))) is AllocStatus.OK  # exactly the pool
    assert bm.can_allocate(list(range(17))) is AllocStatus.NEVER  # 5 blocks > 4, ever
    bm.allocate(1, list(range(9)))  # 3 blocks
    assert bm.can_allocate(list(range(4))) is AllocStatus.OK
    assert bm.can_allocate(list(range(5))) is AllocStatus.LATER
    bm.check_invariants()


def test_watermark_keeps_blocks_back() -> None:
    bm = make(num_device=10, watermark=0.2)  # 2 blocks of watermark
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(list(range(32))) is AllocStatus.OK  # 8 of 10, leaves 2
    assert bm.can_allocate(list(range(33))) is AllocStatus.NEVER  # 9 of 10 would dip into the watermark
    bm.allocate(1, list(range(20)))  # 5 blocks
    assert bm.can_allocate(list(range(12))) is AllocStatus.OK  # 3 more leaves 2
    assert bm.can_allocate(list(range(13))) is AllocStatus.LATER  # 4 more would leave 1
    bm.free(1)
    assert bm.can_allocate(list(range(13))) is AllocStatus.OK


def test_allocate_free_round_trip() -> None:
    bm = make()
    assert bm.allocate(1, list(range(6))) == 0
    assert len(bm.get_block_table(1)) == 2
    assert bm.num_free_device_blocks == 6 and bm.usage() == pytest.approx(2 / 8)
    bm.allocate(2, [7])
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    assert bm.num_free_device_blocks == 8 and not bm.has_seq(1) and bm.usage() == 0.0
    bm.check_invariants()


def test_misuse_raises_without_leaking() -> None:
    bm = make(num_device=2)
    bm.allocate(1, [1, 2])
    with pytest.raises(ValueError):
        bm.allocate(1, [1])
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2, list(range(9)))
    with pytest.raises(ValueError):
        bm.append_slots(1, 1, 2)  # computed beyond total
    assert not bm.has_seq(2)
    bm.check_invariants()


def test_free_unknown_seq_is_harmless() -> None:
    bm = make()
    bm.free(42)
    bm.allocate(1, [1])
    bm.free(1)
    bm.free(1)
    assert bm.num_free_device_blocks == 8
    bm.check_invariants()


# --- growth and copy-on-write ---


def test_append_slots_grows_a_block_at_a_time() -> None:
    bm = make()
    bm.allocate(1, [1, 2, 3, 4])
    assert bm.append_slots(1, 4, 0) == []  # prefill: no growth
    assert bm.append_slots(1, 5, 4) == [] and len(bm.get_block_table(1)) == 2
    assert bm.append_slots(1, 6, 5) == [] and len(bm.get_block_table(1)) == 2
    bm.check_invariants()


def test_fork_then_append_copies_once() -> None:
    bm = make()
    bm.allocate(1, [1, 2, 3, 4, 5, 6])  # 2 blocks, the last partial
    bm.fork(1, 2)
    full, last = bm.get_block_table(1)
    assert bm.num_free_device_blocks == 6  # sharing costs nothing
    assert bm.can_append_slots([(1, 7, 6), (2, 7, 6)])
    copies = bm.append_slots(1, 7, 6)
    assert len(copies) == 1 and copies[0][0] == last
    new = copies[0][1]
    assert bm.get_block_table(1) == [full, new]
    assert bm.append_slots(2, 7, 6) == []  # the sibling now owns the original alone
    assert bm.get_block_table(2) == [full, last]
    bm.check_invariants()


def test_can_append_slots_counts_one_copy_for_two_siblings() -> None:
    bm = make(num_device=3)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.fork(1, 2)  # 2 used, 1 free
    assert bm.can_append_slots([(1, 6, 5), (2, 6, 5)])  # one copy, not two
    bm.fork(1, 3)
    assert not bm.can_append_slots([(1, 6, 5), (2, 6, 5), (3, 6, 5)])  # two copies, one free block
    assert bm.can_append_slots([(1, 6, 5)])


# --- prefix caching ---


def test_prefix_hits_shared_prefix_with_different_tails() -> None:
    bm = make(num_device=16, caching=True)
    prefix = list(range(100, 112))  # 3 full blocks
    a, b = prefix + [1, 2], prefix + [3, 4, 5, 6, 7]
    assert bm.allocate(1, a) == 0
    bm.mark_computed(1, a, 8)  # only 2 blocks computed so far
    assert bm.allocate(2, b) == 8
    bm.mark_computed(1, a, len(a))
    assert bm.allocate(3, b) == 12
    assert bm.get_block_table(3)[:3] == bm.get_block_table(1)[:3]
    assert bm.get_block_table(3)[3] not in bm.get_block_table(2)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (len(a) + 2 * len(b), 20)
    bm.check_invariants()


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    bm = make(caching=True)
    prompt = list(range(12))  # exactly 3 full blocks
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 12)
    assert bm.allocate(2, prompt) == 8
    t1, t2 = bm.get_block_table(1), bm.get_block_table(2)
    assert t2[:2] == t1[:2] and t2[2] != t1[2]
    assert bm.append_slots(2, 12, 8) == []  # the recomputed block is exclusively its own
    bm.check_invariants()


def test_blocks_are_not_hittable_before_computed() -> None:
    bm = make(num_device=16, caching=True)
    prompt = list(range(9))
    bm.allocate(1, prompt)
    assert bm.allocate(2, prompt) == 0
    bm.mark_computed(1, prompt, 3)  # less than a block
    assert bm.allocate(3, prompt) == 0


def test_freed_cached_blocks_stay_hittable_and_count_as_free() -> None:
    bm = make(num_device=4, caching=True, watermark=0.0)
    prompt = list(range(9))
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 9)
    bm.free(1)
    assert bm.num_free_device_blocks == 4 and bm.usage() == 0.0
    assert bm.can_allocate(prompt + list(range(7))) is AllocStatus.OK  # 4 blocks: 2 hits revived + 2 fresh
    assert bm.allocate(2, prompt) == 8  # revived from the evictor
    assert bm.num_free_device_blocks == 1
    bm.check_invariants()


def test_eviction_takes_uncached_first_then_lru() -> None:
    bm = make(num_device=6, caching=True)
    old, new = [10, 11, 12, 13, 99], [20, 21, 22, 23, 99]
    for seq_id, prompt in ((1, old), (2, new)):
        bm.allocate(seq_id, prompt)
        bm.mark_computed(seq_id, prompt, len(prompt))
    bm.free(1)  # released first: least recent
    bm.free(2)
    bm.allocate(3, list(range(8)))  # takes 2 never-cached free blocks: no eviction
    assert bm.allocate(4, old) == 4 and bm.allocate(5, new) == 4  # both prefixes survived
    bm.free(4)
    bm.free(5)
    bm.allocate(6, list(range(9)))  # 2 uncached tails, then evicts old's block, the least recently released
    bm.free(3)
    assert bm.allocate(7, new) == 4
    bm.free(7)
    assert bm.allocate(8, old) == 0
    bm.check_invariants()


def test_reset_prefix_cache() -> None:
    bm = make(caching=True)
    prompt = list(range(9))
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 9)
    assert not bm.reset_prefix_cache()  # blocks in use
    bm.free(1)
    assert bm.reset_prefix_cache()
    assert bm.allocate(2, prompt) == 0
    bm.check_invariants()


# --- swap ---


def test_swap_round_trip_of_a_forked_group_keeps_sharing() -> None:
    bm = make(num_device=8, num_cpu=4)
    bm.allocate(1, list(range(6)))
    bm.fork(1, 2)
    bm.append_slots(1, 7, 6)  # copy of the last block: 3 distinct blocks
    assert bm.can_swap_out([1, 2])
    out = bm.swap_out([1, 2])
    assert len(out) == 3 and bm.is_swapped(1) and bm.is_swapped(2)
    assert bm.num_free_device_blocks == 8 and bm.num_free_cpu_blocks == 1
    cpu = dict(out)
    assert bm.get_block_table(1)[0] == bm.get_block_table(2)[0] == cpu[out[0][0]]
    bm.check_invariants()
    assert bm.can_swap_in([1, 2]) is AllocStatus.OK
    back = bm.swap_in([1, 2])
    assert len(back) == 3 and not bm.is_swapped(1)
    assert bm.num_free_cpu_blocks == 4 and bm.num_free_device_blocks == 5
    t1, t2 = bm.get_block_table(1), bm.get_block_table(2)
    assert t1[0] == t2[0] and t1[1] != t2[1]
    assert bm.append_slots(2, 7, 6) == []  # the sibling still owns its block alone
    bm.check_invariants()


def test_swap_capacity_answers() -> None:
    bm = make(num_device=4, num_cpu=2)
    bm.allocate(1, list(range(12)))
    assert not bm.can_swap_out([1])  # 3 blocks, 2 CPU blocks
    bm.free(1)
    bm.allocate(1, list(range(8)))
    bm.swap_out([1])
    bm.allocate(2, list(range(12)))
    assert bm.can_swap_in([1]) is AllocStatus.LATER
    with pytest.raises(ValueError):
        bm.append_slots(1, 9, 8)  # swapped seqs do not grow
    bm.free(1)  # frees CPU blocks
    assert bm.num_free_cpu_blocks == 2
    bm.check_invariants()


def test_swap_out_keeps_prefix_blocks_shared_with_other_requests() -> None:
    bm = make(num_device=8, num_cpu=8, caching=True)
    prompt = list(range(9))
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 9)
    assert bm.allocate(2, prompt) == 8
    shared = bm.get_block_table(1)[:2]
    bm.swap_out([2])
    assert bm.get_block_table(1)[:2] == shared  # request 1 keeps using them
    bm.check_invariants()
    bm.swap_in([2])
    bm.mark_computed(2, prompt, 9)  # re-registering finds the keys taken: stays uncached, no error
    bm.check_invariants()
