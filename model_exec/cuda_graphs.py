"""CUDA graphs of the model's forward for pure-decode steps, one per batch-size bucket (as vLLM does).

A decode step of n rows runs the graph captured for the smallest bucket b >= n (1, 2, 4, 8, ... up to
max_num_seqs), its inputs padded to b rows. Rows n..b-1 are padding: token 0 at position 0 of a
one-token sequence whose only block is the pad block, a KV block the scheduler never hands out
(`CacheEngine(pad_block=True)`), so the padding writes its key/value there and reads only that.
Their outputs are dropped.

Invariants:
- A graph reads its inputs from static device buffers and writes its output to a static tensor: a
  replay copies the step's (pinned) host inputs into the buffers' first b rows, then replays.
- Every capture is recorded with the pad inputs, so capturing writes only into the pad block.
- The graphs share one memory pool; the largest bucket is captured first, so the smaller ones fit in
  its memory.
- Only pure-decode steps (max_query_len == 1) and only backends with `cuda_graph_capturable`; a
  capture passes `max_seq_len = max_model_len` (an upper bound is all such a backend may read), and a
  block table wider than the buffers (never, for a sequence within max_model_len) runs eagerly.

The bucket and padding arithmetic is plain CPU code (tested without a GPU); capture and replay need CUDA.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_exec.models import CausalLM
from ops.attention.base import AttentionMetadata
from ops.cache_ops import KVCache

logger = logging.getLogger(__name__)

# Batches above this run eagerly however large max_num_seqs is (vLLM's default largest capture size).
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch-size buckets: powers of two below min(max_num_seqs, MAX_CAPTURE_SIZE), then that bound itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}.")
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1 << k for k in range(top.bit_length()) if 1 << k < top]
    return (*sizes, top)


def bucket_for(num_rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding num_rows rows, or None (run eagerly)."""
    for size in sizes:
        if size >= num_rows:
            return size
    return None


@dataclass(frozen=True)
class DecodeInputs:
    """One pure-decode step's host inputs, row i = sequence i (CPU tensors)."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    slot_mapping: torch.Tensor  # [n] int64
    seq_lens: torch.Tensor  # [n] int32
    block_tables: torch.Tensor  # [n, w] int32

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


def pad_decode_inputs(inputs: DecodeInputs, bucket: int, pad_block: int, block_size: int) -> DecodeInputs:
    """inputs padded to `bucket` rows; each pad row is one token whose block is `pad_block`, written at that
    block's first slot."""
    n = inputs.num_rows
    if not 0 < n <= bucket:
        raise ValueError(f"cannot pad a decode batch of {n} rows to a bucket of {bucket}.")
    extra = bucket - n
    if extra == 0:
        return inputs
    long_pad = torch.zeros(extra, dtype=torch.long)
    pad_rows = torch.zeros((extra, inputs.block_tables.shape[1]), dtype=torch.int32)
    pad_rows[:, 0] = pad_block
    return DecodeInputs(
        input_ids=torch.cat([inputs.input_ids, long_pad]),
        positions=torch.cat([inputs.positions, long_pad]),
        slot_mapping=torch.cat([inputs.slot_mapping, torch.full((extra,), pad_block * block_size, dtype=torch.long)]),
        seq_lens=torch.cat([inputs.seq_lens, torch.ones(extra, dtype=torch.int32)]),
        block_tables=torch.cat([inputs.block_tables, pad_rows]),
    )


class DecodeGraphs:
    """The captured graphs and their static buffers (CUDA only)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        *,
        sizes: tuple[int, ...],
        max_model_len: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; got {device}.")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.pad_block = pad_block
        max_rows = sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_rows,), pad_block * block_size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_rows, max_blocks), pad_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_blocks(self) -> int:
        return int(self.block_tables.shape[1])

    def _meta(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            slot_mapping=self.slot_mapping[:rows],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decodes=rows,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm each bucket up eagerly, then record it; largest first, all in one memory pool."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.sizes):
            args = (self.input_ids[:rows], self.positions[:rows], self.kv_caches, self._meta(rows))
            self.model(*args)  # lazy initialisation and kernel autotuning happen outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[rows] = self.model(*args)
            self.graphs[rows] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured CUDA graphs for decode batches %s in %.1f s, %.2f GiB",
            list(self.sizes),
            time.perf_counter() - start,
            used / 2**30,
        )

    def run(self, inputs: DecodeInputs, fill_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Hidden states [bucket, hidden] of the padded batch (rows past inputs.num_rows are padding), or
        None when this batch has no graph (too many rows, or a block table wider than the buffers).
        fill_ids: writes ids the host does not know into the graph's input ids, on the device, before the
        replay (the last step's samples: model_exec/step_launch.py)."""
        bucket = bucket_for(inputs.num_rows, self.sizes)
        if bucket is None or inputs.block_tables.shape[1] > self.max_blocks:
            return None
        padded = pad_decode_inputs(inputs, bucket, self.pad_block, self.block_size)
        width = padded.block_tables.shape[1]
        # Columns past `width` keep earlier steps' ids: a row reads only the blocks its seq_len covers.
        for dst, src in (
            (self.input_ids[:bucket], padded.input_ids),
            (self.positions[:bucket], padded.positions),
            (self.slot_mapping[:bucket], padded.slot_mapping),
            (self.seq_lens[:bucket], padded.seq_lens),
            (self.block_tables[:bucket, :width], padded.block_tables),
        ):
            dst.copy_(src.pin_memory(), non_blocking=True)
        if fill_ids is not None:
            fill_ids(self.input_ids[: inputs.num_rows])
        self.graphs[bucket].replay()
        return self.outputs[bucket]
