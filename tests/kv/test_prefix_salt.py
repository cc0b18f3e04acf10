"""Salted prefix-cache chains: sequences run with different LoRA adapters (or an adapter and the base model)
never share KV blocks, and the base model's keys are exactly the unsalted ones they always were."""

from __future__ import annotations

import hashlib
from array import array

from kv import BlockManager
from kv.prefix_cache import hash_block, hash_full_blocks, salt_of

BLOCK = 4
PROMPT = list(range(100, 113))  # 3 full blocks and one token more
ADAPTER_1 = salt_of((1, 1))  # (lora_int_id, load generation)
ADAPTER_2 = salt_of((2, 1))


def make(num_device: int = 32) -> BlockManager:
    return BlockManager(block_size=BLOCK, num_device_blocks=num_device, num_cpu_blocks=8, enable_prefix_caching=True)


def cached(bm: BlockManager, seq_id: int, prompt: list[int], salt: bytes | None) -> None:
    """Run `prompt` as seq_id to completion and free it: its full blocks stay in the cache."""
    bm.allocate(seq_id, prompt, salt=salt)
    bm.mark_computed(seq_id, prompt, len(prompt))
    bm.free(seq_id)


def test_unsalted_keys_are_the_plain_sha256_chain() -> None:
    first = hashlib.sha256(array("q", PROMPT[:4]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", PROMPT[4:8]).tobytes()).digest()
    assert hash_full_blocks(PROMPT, BLOCK, [], 2) == [first, second]
    assert hash_block(None, PROMPT[:4]) == first


def test_salt_changes_every_key_of_the_chain() -> None:
    base = hash_full_blocks(PROMPT, BLOCK, [], 3)
    one = hash_full_blocks(PROMPT, BLOCK, [], 3, ADAPTER_1)
    two = hash_full_blocks(PROMPT, BLOCK, [], 3, ADAPTER_2)
    assert len(set(base) | set(one) | set(two)) == 9
    assert one == hash_full_blocks(PROMPT, BLOCK, [], 3, salt_of((1, 1)))  # deterministic
    assert salt_of((1, 2)) != ADAPTER_1  # a reloaded id is a new identity
    assert salt_of((1, 1)) not in base  # a salt is never a block key


def test_same_adapter_shares_blocks() -> None:
    bm = make()
    cached(bm, 1, PROMPT, ADAPTER_1)
    assert bm.allocate(2, PROMPT, salt=ADAPTER_1) == 12
    bm.check_invariants()


def test_adapters_and_base_never_share_blocks() -> None:
    bm = make()
    cached(bm, 1, PROMPT, ADAPTER_1)
    assert bm.allocate(2, PROMPT) == 0  # the base model
    assert bm.allocate(3, PROMPT, salt=ADAPTER_2) == 0
    bm.mark_computed(2, PROMPT, len(PROMPT))
    bm.mark_computed(3, PROMPT, len(PROMPT))
    assert bm.allocate(4, PROMPT, salt=salt_of((1, 2))) == 0  # adapter 1 reloaded: its old blocks are stale
    # each identity still finds its own blocks
    assert bm.allocate(5, PROMPT) == 12
    assert bm.allocate(6, PROMPT, salt=ADAPTER_2) == 12
    assert bm.allocate(7, PROMPT, salt=ADAPTER_1) == 12
    tables = [bm.get_block_table(s)[:3] for s in (5, 6, 7)]
    assert len({b for t in tables for b in t}) == 9
    for seq_id in range(2, 8):
        bm.free(seq_id)
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks


def test_salt_survives_growth_from_a_short_prompt_and_forks() -> None:
    """A prompt shorter than a block has no key at allocation: its first keys are made while it decodes, and
    must still hang off its salt; a fork made then inherits it."""
    bm = make()
    tokens = PROMPT[:2]
    bm.allocate(1, tokens, salt=ADAPTER_1)
    bm.fork(1, 2)
    tokens = PROMPT[:8]  # both sequences grew the same tokens
    for seq_id in (1, 2):
        bm.append_slots(seq_id, len(tokens), 2)
    bm.mark_computed(2, tokens, len(tokens))  # registers the child's copies under the salted keys
    bm.mark_computed(1, tokens, len(tokens))
    bm.free(1)
    bm.free(2)
    assert bm.allocate(3, PROMPT, salt=ADAPTER_1) == 8
    assert bm.allocate(4, PROMPT) == 0
    bm.check_invariants()


def test_swap_keeps_the_salt() -> None:
    bm = make()
    bm.allocate(1, PROMPT, salt=ADAPTER_2)
    bm.swap_out([1])
    bm.swap_in([1])  # fresh device blocks, registered again below
    bm.mark_computed(1, PROMPT, len(PROMPT))
    bm.free(1)
    assert bm.allocate(2, PROMPT) == 0
    assert bm.allocate(3, PROMPT, salt=ADAPTER_2) == 12
    bm.check_invariants()
