"""Paged attention in Triton (CUDA; Triton ships with every CUDA build of torch): the cache is read in place.

New keys/values are scattered into the cache first (`triton_kernels.write_kv_kernel`, K and V in one
launch, as `ops.cache_ops.write_to_paged_cache` would in two), then one launch of
`triton_kernels.paged_attention_kernel` attends every scheduled token, decodes and prefill chunks on
cached context alike, reading each key/value through the block table where it lies: nothing is
gathered, no per-step temporaries beyond the output (and, for split decode steps, the small fp32
partials). No host read of device tensors: the launch needs only the tensor shapes and the host-side
`max_query_len` / `max_seq_len` of the metadata, so a step costs no synchronisation.

Launch shapes (not yet tuned on a GPU; CI checks what the kernels compute through Triton's interpreter,
and that every launch variant compiles for sm_80/sm_90, in tests/ops/test_triton_attention.py):
- pure-decode step: one program per (row, KV head), its query block the row's token times the group's
  query heads (BLOCK_M = 16 covers groups up to 16); when rows x KV heads are too few to fill the GPU,
  each row's keys split into 2..16 segments merged by a second small kernel (`decode_segments`).
- step with a prefill chunk: 64 query vectors per program (64 // group tokens of a row times the group).
Keys go in tiles of 64 (32 in fp32, whose tiles take twice the registers).

Supports fp16/bf16/fp32 caches, GQA/MQA, any KV block size, head_dim up to 256, sliding windows and
logit soft-capping (semantics in `ops.attention.base`). `triton` is imported in `__init__`, so this
module imports on machines without it.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ops.attention.base import AttentionBackend, AttentionMetadata, StepKV

_MAX_HEAD_DIM = 256
_MAX_SEGMENTS = 16
# A decode segment is worth its launch and merge only over at least this many keys.
_MIN_KEYS_PER_SEGMENT = 128


def _pow2_at_least(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def decode_segments(num_rows: int, num_kv_heads: int, max_keys: int, num_sms: int) -> int:
    """How many key segments each decode row's attention splits into (a power of two, 1..16);
    `max_keys` is the most keys a row attends (its window caps it).

    Double while the doubled program count (rows x KV heads x segments) stays within two per SM and
    segments stay at least `_MIN_KEYS_PER_SEGMENT` keys long: one long-context stream (8 KV heads on
    132 SMs) otherwise runs on 8 SMs, while a full batch needs no split (and no merge pass)."""
    programs = num_rows * num_kv_heads
    segments = 1
    while (
        segments < _MAX_SEGMENTS
        and programs * segments * 2 <= 2 * num_sms
        and max_keys >= 2 * segments * _MIN_KEYS_PER_SEGMENT
    ):
        segments *= 2
    return segments


_sm_counts: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter (CPU tensors) runs programs one by one: nothing to fill
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # Capturable (its row in registry.py): a decode step reads only tensors and host ints fixed at capture
    # (max_seq_len = max_model_len then: more key segments than needed, each row still bounded by its own
    # seq_len), with no host sync.

    def _prepare(self) -> None:
        if self.head_dim > _MAX_HEAD_DIM:
            raise ValueError(f"attention_backend='triton' supports head_dim <= {_MAX_HEAD_DIM}; got {self.head_dim}.")
        self._kernels: ModuleType = self._import("ops.attention.triton_kernels")
        self._group = self.num_heads // self.num_kv_heads
        self._head_dim_p = _pow2_at_least(self.head_dim, 16)

    def _check(self, query: torch.Tensor, kv: StepKV) -> None:
        self._check_dtypes(query, kv)

    def _attend(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        num_tokens, num_seqs = query.shape[0], meta.num_seqs
        if num_tokens == 0:
            return out
        key_cache, value_cache = kv.key_cache, kv.value_cache
        decode_only = meta.max_query_len == 1  # then num_tokens == num_seqs: one query block per row
        segments = 1
        if decode_only:
            keys = meta.max_seq_len if self.sliding_window is None else min(meta.max_seq_len, self.sliding_window)
            segments = decode_segments(num_seqs, self.num_kv_heads, keys, _num_sms(query.device))
        consts = self.attention_constexprs(key_cache.dtype, key_cache.shape[1], decode_only, segments)
        # Rows' query blocks are numbered qsl[r] // BLOCK_Q + r (triton_kernels): this many at most.
        num_q_blocks = num_seqs if decode_only else num_tokens // int(consts["BLOCK_Q"]) + num_seqs
        if segments > 1:
            part_acc = torch.empty(num_tokens, self.num_heads, segments, self.head_dim, device=query.device)
            part_max = torch.empty(num_tokens, self.num_heads, segments, device=query.device)
            part_sum = torch.empty_like(part_max)
        else:  # unused by the kernel (NUM_SEGMENTS == 1 compiles their stores away)
            part_acc = part_max = part_sum = out
        block_tables = meta.block_tables.contiguous()
        self._kernels.paged_attention_kernel[(num_q_blocks, self.num_kv_heads, segments)](
            out, part_acc, part_max, part_sum,
            query, key_cache, value_cache,
            block_tables, meta.seq_lens, meta.query_start_loc,
            num_seqs, self.scale, self.logits_soft_cap or 0.0,
            *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
            **consts,
        )  # fmt: skip
        if segments > 1:
            self._kernels.reduce_segments_kernel[(num_tokens, self.num_heads)](
                out, part_acc, part_max, part_sum, *out.stride(), **self.reduce_constexprs(segments)
            )
        return out

    def attention_constexprs(
        self, cache_dtype: torch.dtype, block_size: int, decode_only: bool, segments: int
    ) -> dict[str, int | bool | str]:
        """The compile-time parameters of `paged_attention_kernel` for one launch (one compiled variant each)."""
        fp32 = cache_dtype == torch.float32
        # Decode: one token per program, the group's heads padded to tl.dot's 16 rows. Prefill: 64 rows.
        block_m = _pow2_at_least(self._group, 16 if decode_only else 64)
        return {
            "NUM_HEADS": self.num_heads,
            "GROUP": self._group,
            "HEAD_DIM": self.head_dim,
            "HEAD_DIM_P": self._head_dim_p,
            "BLOCK_SIZE": block_size,
            "BLOCK_Q": block_m // self._group,
            "BLOCK_M": block_m,
            "TILE": 32 if fp32 else 64,  # fp32 tiles take twice the registers and shared memory
            "WINDOW": self.sliding_window or 0,
            "SOFT_CAP": self.logits_soft_cap is not None,
            "DECODE_ONLY": decode_only,
            "NUM_SEGMENTS": segments,
            "PRECISION": "ieee" if fp32 else "tf32",  # fp32 stays fp32 (no TF32); halves ignore it
        }

    def reduce_constexprs(self, segments: int) -> dict[str, int]:
        return {
            "NUM_HEADS": self.num_heads,
            "HEAD_DIM": self.head_dim,
            "HEAD_DIM_P": self._head_dim_p,
            "NUM_SEGMENTS": segments,
        }

    def write_kv_constexprs(self, block_size: int) -> dict[str, int]:
        return {
            "NUM_KV_HEADS": self.num_kv_heads,
            "HEAD_DIM": self.head_dim,
            "NUM_KV_HEADS_P": _pow2_at_least(self.num_kv_heads, 1),
            "HEAD_DIM_P": self._head_dim_p,
            "BLOCK_SIZE": block_size,
        }

    def _write_kv(self, kv: StepKV, slot_mapping: torch.Tensor) -> None:
        """The step's new K/V into their cache slots, cast to the cache dtype: one launch for both."""
        key, value, key_cache, value_cache = kv
        if key.shape[0] == 0:
            return  # an empty grid does not launch
        self._kernels.write_kv_kernel[(key.shape[0],)](
            key, value, key_cache, value_cache, slot_mapping,
            *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
            **self.write_kv_constexprs(key_cache.shape[1]),
        )  # fmt: skip
