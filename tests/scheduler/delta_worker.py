"""The part every fake worker of the scheduler tests shares: rebuild each sequence from the step deltas alone.

A fake worker holds what a real one holds between steps (each sequence's tokens and block table) and a fake
KV cache whose slots hold whatever the subclass writes there; `apply` plays one SchedulerOutput's
bookkeeping (forget, swap out, swap in, copy-on-write, new and cached sequences) in the real order and
returns the rows the step runs. If a delta were lost or duplicated, the rebuilt tokens or tables (and so
what the subclass's checks read from the KV) would differ from the scheduler's.
"""

from __future__ import annotations

from typing import Any

from scheduler.outputs import NewSeqData, SchedulerOutput


class DeltaWorker:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.kv: dict[int, list[Any]] = {b: [None] * block_size for b in range(num_blocks)}
        self.cpu_kv: dict[int, list[Any]] = {}

    def on_new(self, new: NewSeqData) -> None:
        """A sequence (re)entered the batch in full: subclasses keep what else they need of it."""

    def apply(self, so: SchedulerOutput) -> list[tuple[int, int, int]]:
        """Apply the step's deltas; returns its rows as (seq_id, num_computed_tokens, num_scheduled_tokens)."""
        for seq_id in so.finished_seq_ids:
            self.tokens.pop(seq_id, None)
            self.tables.pop(seq_id, None)
        for dev, cpu in so.blocks_to_swap_out:
            self.cpu_kv[cpu] = list(self.kv[dev])
        for cpu, dev in so.blocks_to_swap_in:
            self.kv[dev] = list(self.cpu_kv[cpu])
        for src, dst in so.blocks_to_copy:
            self.kv[dst] = list(self.kv[src])
        rows = []
        for new in so.new_seqs:
            self.tokens[new.seq_id] = list(new.token_ids)
            self.tables[new.seq_id] = list(new.block_ids)
            self.on_new(new)
            rows.append((new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens))
        for c in so.cached_seqs:
            self.tokens[c.seq_id].extend(c.new_token_ids)
            del self.tables[c.seq_id][c.num_kept_blocks :]
            self.tables[c.seq_id].extend(c.new_block_ids)
            rows.append((c.seq_id, c.num_computed_tokens, c.num_scheduled_tokens))
        return rows
