"""Stateful property tests: random allocate / step / fork / free / swap histories against a small pool.

The machine also plays the cache engine: it keeps what each physical block holds (offset -> token id), applies
the copy-on-write and swap pairs the manager returns, and writes the tokens each step computes. So beyond the
manager's own invariants it checks that (a) no write lands in a block that another sequence also points to,
(b) a prefix hit hands out blocks holding exactly the hitting prompt's tokens, and (c) swapping preserves
contents: every live sequence's computed positions always read back its own tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kv import AllocStatus, BlockManager, NoFreeBlocksError

BS, NUM_DEVICE, NUM_CPU = 4, 16, 8
# Shared prompt stems, so random prompts often share full blocks (and so hit the prefix cache).
STEMS = [list(range(100, 116)), list(range(200, 216)), [7] * 16]

Contents = dict[int, dict[int, int]]  # physical block -> {offset in block: token id}


@dataclass
class SeqModel:
    tokens: list[int]
    num_computed: int


def _pick(keys: list[int], index: int) -> int:
    return sorted(keys)[index % len(keys)]


def _pick_group(keys: list[int], mask: int) -> list[int]:
    """A non-empty subset of `keys` chosen by the bits of `mask`."""
    keys = sorted(keys)
    return [k for i, k in enumerate(keys) if mask >> i & 1] or keys[:1]


class BlockManagerMachine(RuleBasedStateMachine):
    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(BS, NUM_DEVICE, NUM_CPU, watermark=0.1, enable_prefix_caching=self.caching)
        self.seqs: dict[int, SeqModel] = {}
        self.device: Contents = {}
        self.cpu: Contents = {}
        self.next_id = 0

    # --- helpers ---

    def _on_device(self) -> list[int]:
        return [s for s in self.seqs if not self.bm.is_swapped(s)]

    def _on_cpu(self) -> list[int]:
        return [s for s in self.seqs if self.bm.is_swapped(s)]

    def _device_refs(self, block: int) -> int:
        return sum(self.bm.get_block_table(s).count(block) for s in self._on_device())

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # --- rules ---

    @rule(
        stem=st.integers(0, len(STEMS) - 1),
        stem_len=st.sampled_from([0, 3, 4, 5, 8, 9, 12, 16]),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=6),
    )
    def allocate(self, stem: int, stem_len: int, tail: list[int]) -> None:
        prompt = STEMS[stem][:stem_len] + tail
        status = self.bm.can_allocate(prompt)
        if status is AllocStatus.NEVER:
            assert NUM_DEVICE - -(-len(prompt) // BS) < self.bm.watermark_blocks
            return
        if status is AllocStatus.LATER:
            return
        seq_id = self._new_id()
        num_computed = self.bm.allocate(seq_id, prompt)
        assert num_computed % BS == 0 and num_computed <= len(prompt) - 1
        if num_computed:
            event("prefix hit")
        assert len(self.bm.get_block_table(seq_id)) == -(-len(prompt) // BS)
        self.seqs[seq_id] = SeqModel(list(prompt), num_computed)  # (b) is checked by `contents_match`

    @rule(
        mask=st.integers(1, 255),
        chunks=st.lists(st.integers(1, 8), min_size=8, max_size=8),
        sampled=st.integers(0, 2),
    )
    def step(self, mask: int, chunks: list[int], sampled: int) -> None:
        """One engine step for some device seqs: grow, copy on write, write, register computed blocks."""
        if not self._on_device():
            return
        group = _pick_group(self._on_device(), mask)
        plan: list[tuple[int, int, int]] = []
        for seq_id, chunk in zip(group, chunks, strict=False):
            model = self.seqs[seq_id]
            if model.num_computed == len(model.tokens):  # decode: the sampled token runs next
                model.tokens.append(sampled)
            plan.append((seq_id, min(len(model.tokens), model.num_computed + chunk), model.num_computed))
        if not self.bm.can_append_slots(plan):
            event("append refused")
            trial = copy.deepcopy(self.bm)  # the answer is exact: the appends really do not fit
            with pytest.raises(NoFreeBlocksError):
                for args in plan:
                    trial.append_slots(*args)
            return
        for seq_id, total, computed in plan:
            for src, dst in self.bm.append_slots(seq_id, total, computed):
                event("copy on write")
                self.device[dst] = dict(self.device.get(src, {}))
            table = self.bm.get_block_table(seq_id)
            assert len(table) * BS >= total
            for pos in range(computed, total):
                block = table[pos // BS]
                assert self._device_refs(block) == 1, f"(a) write to shared block {block}"
                self.device.setdefault(block, {})[pos % BS] = self.seqs[seq_id].tokens[pos]
            self.seqs[seq_id].num_computed = total
            self.bm.mark_computed(seq_id, self.seqs[seq_id].tokens, total)

    @rule(index=st.integers(0, 63))
    def fork(self, index: int) -> None:
        if not self.seqs:
            return
        parent = _pick(list(self.seqs), index)
        child = self._new_id()
        self.bm.fork(parent, child)
        self.seqs[child] = copy.deepcopy(self.seqs[parent])

    @rule(index=st.integers(0, 63), unknown=st.booleans())
    def free(self, index: int, unknown: bool) -> None:
        if unknown or not self.seqs:
            self.bm.free(10_000 + index)
            return
        seq_id = _pick(list(self.seqs), index)
        self.bm.free(seq_id)
        del self.seqs[seq_id]

    @rule(mask=st.integers(1, 255))
    def swap_out(self, mask: int) -> None:
        if not self._on_device():
            return
        group = _pick_group(self._on_device(), mask)
        distinct = {b for s in group for b in self.bm.get_block_table(s)}
        if not self.bm.can_swap_out(group):
            assert len(distinct) > self.bm.num_free_cpu_blocks
            return
        pairs = self.bm.swap_out(group)
        event("swap out")
        assert sorted(d for d, _ in pairs) == sorted(distinct), "each distinct block moves exactly once"
        for dev, cpu in pairs:
            self.cpu[cpu] = dict(self.device.get(dev, {}))

    @rule(mask=st.integers(1, 255))
    def swap_in(self, mask: int) -> None:
        if not self._on_cpu():
            return
        group = _pick_group(self._on_cpu(), mask)
        if self.bm.can_swap_in(group) is not AllocStatus.OK:
            return
        pairs = self.bm.swap_in(group)
        event("swap in")
        assert len({c for c, _ in pairs}) == len({d for _, d in pairs}) == len(pairs)
        for cpu, dev in pairs:
            self.device[dev] = dict(self.cpu.get(cpu, {}))

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.bm.reset_prefix_cache() == (self.bm.usage() == 0.0)

    # --- invariants ---

    @invariant()
    def manager_invariants(self) -> None:
        self.bm.check_invariants()
        assert 0.0 <= self.bm.usage() <= 1.0

    @invariant()
    def contents_match(self) -> None:
        """(b) and (c): every computed position of every live seq reads back its own token."""
        for seq_id, model in self.seqs.items():
            table = self.bm.get_block_table(seq_id)
            store = self.cpu if self.bm.is_swapped(seq_id) else self.device
            for pos in range(model.num_computed):
                held = store.get(table[pos // BS], {}).get(pos % BS)
                assert held == model.tokens[pos], f"seq {seq_id} position {pos}: holds {held}"


class BlockManagerNoCachingMachine(BlockManagerMachine):
    caching = False


_SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBlockManagerWithPrefixCaching = BlockManagerMachine.TestCase
TestBlockManagerWithPrefixCaching.settings = _SETTINGS
TestBlockManagerWithoutPrefixCaching = BlockManagerNoCachingMachine.TestCase
TestBlockManagerWithoutPrefixCaching.settings = _SETTINGS
