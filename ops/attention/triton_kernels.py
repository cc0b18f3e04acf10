"""Triton paged-attention kernels: every key and value is read through the block table where it lies.

Imported only by `triton_backend` (never at `ops.attention` import), so machines without Triton import
the package. The same kernels run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`),
which is how CI checks them without a GPU.

`paged_attention_kernel`: one program per (query block, KV head, key segment).
- A query block is BLOCK_Q consecutive new tokens of one row times the GROUP query heads sharing the KV
  head, flattened into BLOCK_M = BLOCK_Q * GROUP (padded to a power of two, >= 16 for `tl.dot`) query
  vectors, so GQA/MQA load every K/V tile once for the whole group.
- Rows own the query blocks `query_start_loc[r] // BLOCK_Q + r ...`: that numbering needs no host pass
  (row r's ceil(q_len / BLOCK_Q) blocks always fit before row r+1's first one), the grid is its upper
  bound `num_tokens // BLOCK_Q + num_seqs`, and a program finds its row by binary search; a pure-decode
  step (DECODE_ONLY) has one block per row and skips the search.
- Query i of a row sits at position seq_len - q_len + i (new tokens are already in the cache); keys run
  in TILE-wide tiles from the window's first tile to the block's last query, with an online softmax in
  fp32 (base 2). Each key's block is looked up per key (`k_pos // BLOCK_SIZE`), so a tile may span
  blocks and any block size works.
- NUM_SEGMENTS > 1 (decode steps with too few rows x heads to fill the GPU) splits each row's tiles into
  that many segments; each writes its unnormalised partial (acc, running max, sum) and
  `reduce_segments_kernel` merges them (split-KV / flash-decoding).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_row(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The row whose query blocks include `q_block`: the last r with qsl[r] // BLOCK_Q + r <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Decision: the two ints that change from step to step (the batch's row count and the block table's width)
# are not specialised on. Triton otherwise compiles a variant per value class (== 1, divisible by 16,
# other) of each, up to nine per constexpr set, and a serving engine met them one by one on its first
# batches (3-4 s of JIT on an H200). Neither bounds an inner loop nor addresses a vectorised load
# (num_seqs bounds the row search, stride_bt one scalar load per key tile), so there is little to gain.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def paged_attention_kernel(
    out_ptr,  # [T, Hq, D]                      (NUM_SEGMENTS == 1)
    part_acc_ptr,  # [T, Hq, NUM_SEGMENTS, D] fp32 (NUM_SEGMENTS > 1)
    part_max_ptr,  # [T, Hq, NUM_SEGMENTS] fp32
    part_sum_ptr,  # [T, Hq, NUM_SEGMENTS] fp32
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    num_seqs,
    scale,  # softmax scale (natural base)
    soft_cap,  # logits soft cap (used when SOFT_CAP)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * GROUP, a power of two >= 16
    TILE: tl.constexpr,  # keys per inner iteration, a power of two >= 16
    WINDOW: tl.constexpr,  # sliding window in tokens; 0: full causal
    SOFT_CAP: tl.constexpr,
    DECODE_ONLY: tl.constexpr,  # every row has one new token: program_id(0) is the row
    NUM_SEGMENTS: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" keeps fp32 exact (no TF32)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    if DECODE_ONLY:
        row = q_block
        first_q = 0
    else:
        row = _find_row(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        first_q = (q_block - (tl.load(query_start_loc_ptr + row) // BLOCK_Q + row)) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if first_q >= q_len:  # a spare block of the grid's upper bound
        return
    seq_len = tl.load(seq_lens_ptr + row)
    context = seq_len - q_len  # keys before the row's first new token

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = first_q + offs_m // GROUP  # the query token of each of the BLOCK_M vectors (row-local)
    head = kv_head * GROUP + offs_m % GROUP
    m_valid = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)
    q_pos = context + q_idx

    # Keys any query of this block may see: [key_lo, key_hi).
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    key_hi = context + last_q + 1
    key_lo = 0
    if WINDOW > 0:
        key_lo = tl.maximum(context + first_q - WINDOW + 1, 0)
    tile_lo = key_lo // TILE
    tile_hi = tl.cdiv(key_hi, TILE)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
        tile_lo = tile_lo + segment * per_segment
        tile_hi = tl.minimum(tile_hi, tile_lo + per_segment)

    offs_t = tl.arange(0, TILE)
    table = block_tables_ptr + row.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    qk_scale = scale * 1.4426950408889634  # exp2 below: fold log2(e) into the scale
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE + offs_t
        k_valid = k_pos < key_hi
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k = tl.load(  # [HEAD_DIM_P, TILE]
            k_head + block[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd,
            mask=d_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_M, TILE] fp32
        if SOFT_CAP:  # cap * tanh(scale * s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1): finite at both ends
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * scale * s / soft_cap) + 1.0)) * 1.4426950408889634
        else:
            s = s * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :] & m_valid[:, None]
        if WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(s, axis=1))
        # A vector that has seen no visible key yet keeps max -inf; subtract 0 instead (no inf - inf).
        ref = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(s - ref[:, None])
        alpha = tl.exp2(run_max - ref)
        run_sum = run_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(  # [TILE, HEAD_DIM_P]
            v_head + block[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :] * stride_vd,
            mask=k_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        run_max = new_max

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(run_sum == 0.0, 1.0, run_sum)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=m_valid[:, None] & d_valid[None, :],
        )
    else:
        part = (token * NUM_HEADS + head) * NUM_SEGMENTS + segment  # [BLOCK_M] index into [T, Hq, S]
        tl.store(part_max_ptr + part, run_max, mask=m_valid)
        tl.store(part_sum_ptr + part, run_sum, mask=m_valid)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=m_valid[:, None] & d_valid[None, :],
        )


@triton.jit
def reduce_segments_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [T, Hq, NUM_SEGMENTS, D] fp32, unnormalised
    part_max_ptr,  # [T, Hq, NUM_SEGMENTS] fp32, base-2 running max (-inf: the segment saw no key)
    part_sum_ptr,  # [T, Hq, NUM_SEGMENTS] fp32
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """One program per (token, query head): softmax-merge the segments' partials."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * NUM_HEADS + head) * NUM_SEGMENTS
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM
    seg_max = tl.load(part_max_ptr + base + offs_s)
    seg_sum = tl.load(part_sum_ptr + base + offs_s)
    seg_acc = tl.load(
        part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=d_valid[None, :], other=0.0
    )
    top = tl.max(seg_max, axis=0)  # finite: the first segment always holds the row's first visible key
    weight = tl.exp2(seg_max - top)  # 0 for empty segments
    total = tl.sum(seg_sum * weight, axis=0)
    out = tl.sum(seg_acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=d_valid)


@triton.jit
def write_kv_kernel(
    key_ptr,  # [T, Hkv, D], any strides (a view into the fused QKV projection)
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64: block * BLOCK_SIZE + offset
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kb, stride_ks, stride_kch, stride_kcd,
    stride_vb, stride_vs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per new token: its keys and values (all KV heads) into its cache slot, cast to the
    cache dtype; K and V in one launch."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, NUM_KV_HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kb + offset * stride_ks
    v_dst = v_cache_ptr + block * stride_vb + offset * stride_vs
    k_dst += offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    v_dst += offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
