"""Paged attention in plain PyTorch: the CPU default and the reference for the CUDA backends.

Decode rows (one new token each, first in the batch) run as batched
`scaled_dot_product_attention` calls over groups of rows: a group's cache blocks are gathered
through the block table into `[rows, max_blocks * block_size, kv_heads, head_dim]` (a group is
sized so this copy is ~4 MiB and still in cache when SDPA reads it) and keys past each row's
length are masked. GQA goes through SDPA's `enable_gqa`, so K/V are never repeated per query head.

Prefill chunks run one SDPA call per row (a loop over rows, never over tokens). Measured on
2 CPU cores (`python -m benchmarks.attention_bench --compare-prefill`), against all rows padded
into one batched SDPA call: rows 50/200/400/512 6.4 vs 15.0 ms, a 512 chunk + 3 short chunks
3.7 vs 15.0 ms, 1x512 3.5 vs 3.8 ms, 8x64 0.74 vs 0.71 ms. Padding costs a causal
`max_query_len x max_seq_len` block on every short row.
A row with no cached context reads its own new keys directly (top-left causal); a chunk on top of
cached context gathers its blocks and uses a bottom-right causal mask (query i sits at position
seq_len - query_len + i).

Unwritten cache slots are read and then masked; masked-out values are multiplied by zero, so they
must be finite. CacheEngine zero-fills the device pool for that reason.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ops.attention.base import AttentionBackend, AttentionMetadata, StepKV

# Decode rows are gathered in chunks whose K (and V) copy stays under this size, so the gathered
# K/V are still in cache when SDPA reads them, and the workspace stays small whatever the batch.
# Measured on 2 CPU cores (SmolLM2 shapes, 64 rows): one 25 MB chunk 6.2 ms, 4 MiB chunks 4.1 ms;
# at context 2048, 104 ms vs 19 ms. 2 MiB and below lose again to per-call overhead.
_MAX_GATHER_BYTES = 4 << 20


class _GatherWorkspace:
    """Reused CPU buffers for gathered decode K/V.

    Fresh multi-MB tensors per call can cost page faults every time (glibc hands large blocks back
    to the OS); reusing one buffer avoids that (up to 2x on decode in measurements). One workspace
    per thread, shared by every layer and backend instance in that thread (layers run one after
    another); it holds two buffers (K, V) of max(_MAX_GATHER_BYTES, one row's K) each.
    Buffers are keyed by inference mode too: a tensor made under `torch.inference_mode()` cannot be
    written outside it, so a thread that runs both ways (tests, profiling) keeps one buffer for each.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, int, bool], torch.Tensor] = {}

    def gather_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, which: int) -> torch.Tensor:
        """cache[block_ids] into a reused buffer; `which` keeps K and V in separate buffers."""
        shape = (block_ids.numel(), *cache.shape[1:])
        numel = shape[0] * cache[0].numel()
        key = (cache.dtype, which, torch.is_inference_mode_enabled())
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=cache.dtype)
            self._buffers[key] = buf
        out = buf[:numel].view(shape)
        torch.index_select(cache, 0, block_ids, out=out)
        return out


_thread_state = threading.local()


def _workspace() -> _GatherWorkspace:
    ws: _GatherWorkspace | None = getattr(_thread_state, "workspace", None)
    if ws is None:
        ws = _GatherWorkspace()
        _thread_state.workspace = ws
    return ws


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, which: int) -> torch.Tensor:
    if cache.device.type == "cpu":
        return _workspace().gather_blocks(cache, block_ids, which)
    return cache.index_select(0, block_ids)  # the CUDA caching allocator already reuses memory


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def _prepare(self) -> None:
        self._gqa = self.num_heads != self.num_kv_heads

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """q [..., Hq, Lq, D], k/v [..., Hkv, Lk, D], boolean `mask` (True = attend) -> [..., Hq, Lq, D].

        SDPA has no soft-cap, so a soft-capped layer computes the scores itself (Gemma 2 only)."""
        cap = self.logits_soft_cap
        if cap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self._gqa
            )
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=-3)
            v = v.repeat_interleave(group, dim=-3)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        scores = cap * torch.tanh(scores / cap)
        if causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)

    def _attend(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(query)
        num_decodes = meta.num_decodes
        if num_decodes > 0:
            self._decode(query[:num_decodes], kv, meta, out)
        if num_decodes < meta.num_seqs:
            self._prefill(query, kv, meta, out)
        return out

    def _decode(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Rows [0, num_decodes): one query each, attending to all of its row's keys; written into `out`."""
        num_rows = query.shape[0]
        key_cache, value_cache = kv.key_cache, kv.value_cache
        seq_lens = meta.seq_lens[:num_rows]
        # On CPU the decode rows' own max is free to read and can be far below a long prefill's.
        max_len = int(seq_lens.max()) if seq_lens.device.type == "cpu" else meta.max_seq_len
        block_size = key_cache.shape[1]
        num_blocks = -(-max_len // block_size)
        padded_len = num_blocks * block_size
        bytes_per_row = padded_len * key_cache[0, 0].numel() * key_cache.element_size()
        rows_per_chunk = max(1, _MAX_GATHER_BYTES // bytes_per_row)
        key_pos = torch.arange(padded_len, device=query.device)
        for start in range(0, num_rows, rows_per_chunk):
            stop = min(num_rows, start + rows_per_chunk)
            n = stop - start
            block_ids = meta.block_tables[start:stop, :num_blocks].reshape(-1)
            kv_shape = (n, padded_len, self.num_kv_heads, self.head_dim)
            k = _gather_blocks(key_cache, block_ids, 0).view(kv_shape)
            v = _gather_blocks(value_cache, block_ids, 1).view(kv_shape)
            row_lens = seq_lens[start:stop, None].long()  # int32 - a window past 2**31 would wrap
            mask = key_pos < row_lens
            if self.sliding_window is not None:  # the query sits at seq_len - 1
                mask &= key_pos >= row_lens - self.sliding_window
            o = self._sdpa(
                query[start:stop].unsqueeze(2),  # [n, Hq, 1, D]
                k.transpose(1, 2),  # [n, Hkv, L, D], a strided view: no copy
                v.transpose(1, 2),
                mask.view(n, 1, 1, padded_len),
                causal=False,
            )
            out[start:stop] = o.squeeze(2)

    def _prefill(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Rows [num_decodes, num_seqs): one SDPA call per row, written into `out` in place."""
        first = meta.num_decodes
        key, value, key_cache, value_cache = kv
        # One host read per layer for the row bounds; free on CPU, a small sync on CUDA
        # (the flash_attn / xformers backends are the CUDA hot paths).
        starts = meta.query_start_loc[first:].tolist()
        seq_lens = meta.seq_lens[first:].tolist()
        block_size = key_cache.shape[1]
        kv_shape = (-1, self.num_kv_heads, self.head_dim)
        for i, seq_len in enumerate(seq_lens):
            lo, hi = starts[i], starts[i + 1]
            q_len = hi - lo
            q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            if q_len == seq_len:  # no cached context: the new keys are the whole sequence
                k = key[lo:hi].to(query.dtype)
                v = value[lo:hi].to(query.dtype)
                mask = None
            else:
                num_blocks = -(-seq_len // block_size)
                block_ids = meta.block_tables[first + i, :num_blocks]
                k = key_cache.index_select(0, block_ids).view(kv_shape)[:seq_len]
                v = value_cache.index_select(0, block_ids).view(kv_shape)[:seq_len]
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).tril(seq_len - q_len)
            if self.sliding_window is not None:
                # query i sits at p = seq_len - q_len + i and sees keys p - w < key <= p
                if mask is None:
                    mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).tril()
                mask = mask.triu(seq_len - q_len - self.sliding_window + 1)
            o = self._sdpa(
                q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), mask, causal=mask is None
            )
            out[lo:hi] = o[0].transpose(0, 1)
