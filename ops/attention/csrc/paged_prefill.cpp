// Paged prefill attention on the CPU: the prefill rows of a step (several query tokens each, causal,
// possibly on top of cached context: chunked prefill, prefix-cache hits), keys and values read in
// place from the paged cache, which already holds this step's new keys and values.
//
// Layouts (see ops/attention/base.py): query/out [tokens, num_heads, head_dim] (last dim contiguous),
// key/value cache [num_blocks, block_size, num_kv_heads, head_dim] contiguous, block_tables
// [rows, max_blocks] int32, query_start_loc [rows + 1] int32, seq_lens [rows] int32, all fp32.
// Rows [first_row, rows) are computed; a row's query token t (of q_len) sits at position
// seq_len - q_len + t and attends to keys 0 ..= that position, or with a sliding window w (`window` > 0)
// to the keys after position - w only; with `soft_cap` c > 0 the scores become c * tanh(score / c)
// (ops/attention/base.py). A work item's key tiles start at its first query's window, so the keys
// before it are never read; within a tile a query's keys before its window are masked.
//
// Flash-style: a work item is (row, kv head, tile of kQueryTile query positions); its G = heads/kv_heads
// query heads share every K/V read, so an item holds kQueryTile * G query vectors. Keys are visited
// in tiles of 16 with an online softmax (running max and sum per query, output rescaled when the max
// grows), so nothing of size seq_len is ever materialised, and a tile entirely after a query's
// position is skipped for that query: the causal half of the work is never done.
//
// Why not torch's flash SDPA: for SmolLM2's shapes (9/3 heads, head_dim 64) it runs a causal 512-token
// prompt at ~87 GFLOP/s on 2 Zen 5 cores (27% of that prefill's time), and its GQA path cannot share
// K/V reads across a group. Needs the AVX2 + FMA build (the loader passes -mavx2 -mfma when the
// machine has them) and head_dim a multiple of 8; otherwise ops/attention/cpu_backend.py keeps the
// torch path. Where the CPU has AVX-512F and head_dim is 64 or 128, each work item runs the AVX-512
// job instead (run-time check, raytp::use_avx512): ~2.2x faster (benchmarks/attention_bench.py
// figures in cpu_backend.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "../../csrc/vec_math.h"
#endif

namespace {

constexpr int64_t kQueryTile = 16;  // query positions per work item
constexpr int64_t kKeyTile = 16;    // keys per online-softmax step (two 8-lane vectors)

struct Job {
  int64_t row, kv_head, t0, t1;  // query positions [t0, t1) of the row, 0-based within its chunk
};

// The first key any query of the item sees: the window of its first query (position ctx + t0).
inline int64_t key_range_begin(const Job& job, int64_t ctx, int64_t w) {
  return std::max<int64_t>(0, ctx + job.t0 - w + 1);
}

#if defined(__AVX2__) && defined(__FMA__)

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// One work item; `scratch` is the calling thread's, reused across its items.
void run_job(const Job& job, const float* query, const float* key_cache, const float* value_cache,
             const int32_t* block_table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t q_row_stride,
             int64_t q_head_stride, int64_t o_row_stride, int64_t o_head_stride, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window, float cap,
             float* out, std::vector<float>& scratch) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t D = head_dim;
  const int64_t nt = job.t1 - job.t0;
  const int64_t nq = nt * group;  // query vector n = t * group + h
  const int64_t ctx = seq_len - q_len;
  const int64_t token_stride = num_kv_heads * D;  // floats between consecutive cache slots
  // q, o [nq, D]; kt [D, 16]; s [nq, 16]; m, l, corr, vis [nq].
  scratch.resize(static_cast<size_t>(2 * nq * D + D * kKeyTile + nq * kKeyTile + 4 * nq));
  float* q = scratch.data();
  float* o = q + nq * D;
  float* kt = o + nq * D;
  float* s = kt + D * kKeyTile;
  float* m = s + nq * kKeyTile;
  float* l = m + nq;
  float* corr = l + nq;
  float* vis = corr + nq;  // keys of the current tile each query sees (at most 16: exact as a float)
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t t = 0; t < nt; ++t) {
    for (int64_t h = 0; h < group; ++h) {
      const float* src = query + (q_start + job.t0 + t) * q_row_stride + (job.kv_head * group + h) * q_head_stride;
      float* dst = q + (t * group + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  }
  std::fill(o, o + nq * D, 0.f);
  std::fill(m, m + nq, neg_inf);
  std::fill(l, l + nq, 0.f);

  // Query at position p sees keys p - w < k <= p; w = seq_len (no window, or a wider one) reaches key 0.
  const int64_t w = window > 0 ? std::min(window, seq_len) : seq_len;
  const int64_t key_end = ctx + job.t1;  // the last query's position + 1
  for (int64_t k0 = key_range_begin(job, ctx, w); k0 < key_end; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, key_end - k0);
    // Gather this tile's keys transposed (kt[d][j]); slots past nk are zero and masked below.
    const float* vrow[kKeyTile];
    for (int64_t j = 0; j < kKeyTile; ++j) {
      if (j < nk) {
        const int64_t pos = k0 + j;
        const int64_t slot = static_cast<int64_t>(block_table[pos / block_size]) * block_size + pos % block_size;
        const float* krow = key_cache + slot * token_stride + job.kv_head * D;
        vrow[j] = value_cache + slot * token_stride + job.kv_head * D;
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyTile + j] = krow[d];
      } else {
        vrow[j] = nullptr;
        for (int64_t d = 0; d < D; ++d) kt[d * kKeyTile + j] = 0.f;
      }
    }
    // Queries whose position is before k0 see none of this tile; positions grow with t, so they
    // are a prefix of the item's queries.
    const int64_t first_t = std::max<int64_t>(0, k0 - ctx - job.t0);
    // Queries whose window ends before this tile's last key (position > last key + w - 1) see none of
    // it either: a suffix of the item's queries. Without a window, none.
    const int64_t end_t = std::min<int64_t>(nt, k0 + nk - 1 + w - ctx - job.t0);
    if (first_t >= end_t) continue;
    const int64_t n0 = first_t * group, n1 = end_t * group;

    // Scores, 4 query vectors at a time: s[n][j] = q_n . k_j (16 keys in two vectors).
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(),
             a11 = _mm256_setzero_ps(), a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(),
             a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
      const float* q0 = q + n * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m256 k0v = _mm256_loadu_ps(kt + d * kKeyTile);
        const __m256 k1v = _mm256_loadu_ps(kt + d * kKeyTile + 8);
        __m256 b = _mm256_broadcast_ss(q0 + d);
        a00 = _mm256_fmadd_ps(b, k0v, a00);
        a01 = _mm256_fmadd_ps(b, k1v, a01);
        b = _mm256_broadcast_ss(q0 + D + d);
        a10 = _mm256_fmadd_ps(b, k0v, a10);
        a11 = _mm256_fmadd_ps(b, k1v, a11);
        b = _mm256_broadcast_ss(q0 + 2 * D + d);
        a20 = _mm256_fmadd_ps(b, k0v, a20);
        a21 = _mm256_fmadd_ps(b, k1v, a21);
        b = _mm256_broadcast_ss(q0 + 3 * D + d);
        a30 = _mm256_fmadd_ps(b, k0v, a30);
        a31 = _mm256_fmadd_ps(b, k1v, a31);
      }
      float* sn = s + n * kKeyTile;
      _mm256_storeu_ps(sn, a00);
      _mm256_storeu_ps(sn + 8, a01);
      _mm256_storeu_ps(sn + 16, a10);
      _mm256_storeu_ps(sn + 24, a11);
      _mm256_storeu_ps(sn + 32, a20);
      _mm256_storeu_ps(sn + 40, a21);
      _mm256_storeu_ps(sn + 48, a30);
      _mm256_storeu_ps(sn + 56, a31);
    }
    for (; n < n1; ++n) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      const float* qn = q + n * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m256 b = _mm256_broadcast_ss(qn + d);
        a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(kt + d * kKeyTile), a0);
        a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(kt + d * kKeyTile + 8), a1);
      }
      _mm256_storeu_ps(s + n * kKeyTile, a0);
      _mm256_storeu_ps(s + n * kKeyTile + 8, a1);
    }

    // Causal (and window) mask and online softmax, one query vector at a time: s_n becomes p_n
    // (exactly 0 on the masked keys), m and l are updated, and corr_n is the factor o_n must be
    // rescaled by. Each of these queries sees at least one key of the tile (the range above).
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lane8 = _mm256_add_ps(lane, _mm256_set1_ps(8.f));
    const __m256 cap_v = _mm256_set1_ps(cap), two_over_cap = _mm256_set1_ps(cap > 0.f ? 2.f / cap : 0.f);
    for (n = n0; n < n1; ++n) {
      const int64_t p = ctx + job.t0 + n / group;  // this query's position
      const int64_t visible = std::min<int64_t>(nk, p - k0 + 1);  // keys k0 .. k0+visible-1
      vis[n] = static_cast<float>(visible);
      float* sn = s + n * kKeyTile;
      const __m256 lim = _mm256_set1_ps(static_cast<float>(visible));
      __m256 keep0 = _mm256_cmp_ps(lane, lim, _CMP_LT_OQ);
      __m256 keep1 = _mm256_cmp_ps(lane8, lim, _CMP_LT_OQ);
      if (p - w + 1 > k0) {  // the window starts inside this tile: lanes before its first key go too
        const __m256 low = _mm256_set1_ps(static_cast<float>(p - w + 1 - k0));
        keep0 = _mm256_and_ps(keep0, _mm256_cmp_ps(lane, low, _CMP_GE_OQ));
        keep1 = _mm256_and_ps(keep1, _mm256_cmp_ps(lane8, low, _CMP_GE_OQ));
      }
      const __m256 ninf = _mm256_set1_ps(neg_inf);
      __m256 s0 = _mm256_loadu_ps(sn), s1 = _mm256_loadu_ps(sn + 8);
      if (cap > 0.f) {
        s0 = raytp::soft_cap8(s0, cap_v, two_over_cap);
        s1 = raytp::soft_cap8(s1, cap_v, two_over_cap);
      }
      s0 = _mm256_blendv_ps(ninf, s0, keep0);
      s1 = _mm256_blendv_ps(ninf, s1, keep1);
      const float tile_max = hmax8(_mm256_max_ps(s0, s1));
      const float m_new = std::max(m[n], tile_max);
      corr[n] = m[n] == neg_inf ? 0.f : std::exp(m[n] - m_new);
      const __m256 mv = _mm256_set1_ps(m_new);
      s0 = _mm256_and_ps(raytp::exp8(_mm256_sub_ps(s0, mv)), keep0);  // masked lanes: exactly 0
      s1 = _mm256_and_ps(raytp::exp8(_mm256_sub_ps(s1, mv)), keep1);
      _mm256_storeu_ps(sn, s0);
      _mm256_storeu_ps(sn + 8, s1);
      l[n] = l[n] * corr[n] + raytp::hsum8(_mm256_add_ps(s0, s1));
      m[n] = m_new;
    }

    // o_n = o_n * corr_n + p_n V, two query vectors at a time so each V load feeds two FMAs. A pair
    // runs over the longer of its two visible ranges: the other's extra weights are exactly 0.
    for (n = n0; n < n1; n += 2) {
      const bool pair = n + 1 < n1;
      const auto visible = static_cast<int64_t>(pair ? std::max(vis[n], vis[n + 1]) : vis[n]);
      const float* pa = s + n * kKeyTile;
      const float* pb = pair ? pa + kKeyTile : pa;
      float* oa = o + n * D;
      float* ob = pair ? oa + D : oa;
      const __m256 ca = _mm256_set1_ps(corr[n]);
      const __m256 cb = _mm256_set1_ps(pair ? corr[n + 1] : corr[n]);
      int64_t d0 = 0;
      for (; d0 + 32 <= D; d0 += 32) {  // 32 floats of each o in 4 registers, unrolled (a runtime width spills)
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(oa + d0), ca);
        __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(oa + d0 + 8), ca);
        __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(oa + d0 + 16), ca);
        __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(oa + d0 + 24), ca);
        __m256 b0 = _mm256_mul_ps(_mm256_loadu_ps(ob + d0), cb);
        __m256 b1 = _mm256_mul_ps(_mm256_loadu_ps(ob + d0 + 8), cb);
        __m256 b2 = _mm256_mul_ps(_mm256_loadu_ps(ob + d0 + 16), cb);
        __m256 b3 = _mm256_mul_ps(_mm256_loadu_ps(ob + d0 + 24), cb);
        for (int64_t j = 0; j < visible; ++j) {
          const float* vj = vrow[j] + d0;
          const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8), v2 = _mm256_loadu_ps(vj + 16),
                       v3 = _mm256_loadu_ps(vj + 24);
          const __m256 p = _mm256_broadcast_ss(pa + j);
          a0 = _mm256_fmadd_ps(p, v0, a0);
          a1 = _mm256_fmadd_ps(p, v1, a1);
          a2 = _mm256_fmadd_ps(p, v2, a2);
          a3 = _mm256_fmadd_ps(p, v3, a3);
          const __m256 q = _mm256_broadcast_ss(pb + j);
          b0 = _mm256_fmadd_ps(q, v0, b0);
          b1 = _mm256_fmadd_ps(q, v1, b1);
          b2 = _mm256_fmadd_ps(q, v2, b2);
          b3 = _mm256_fmadd_ps(q, v3, b3);
        }
        _mm256_storeu_ps(oa + d0, a0);
        _mm256_storeu_ps(oa + d0 + 8, a1);
        _mm256_storeu_ps(oa + d0 + 16, a2);
        _mm256_storeu_ps(oa + d0 + 24, a3);
        if (pair) {  // unpaired: b* computed the same vector again; store it once
          _mm256_storeu_ps(ob + d0, b0);
          _mm256_storeu_ps(ob + d0 + 8, b1);
          _mm256_storeu_ps(ob + d0 + 16, b2);
          _mm256_storeu_ps(ob + d0 + 24, b3);
        }
      }
      for (; d0 < D; d0 += 8) {  // head_dim not a multiple of 32: the rest 8 floats at a time
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(oa + d0), ca);
        __m256 b0 = _mm256_mul_ps(_mm256_loadu_ps(ob + d0), cb);
        for (int64_t j = 0; j < visible; ++j) {
          const __m256 v0 = _mm256_loadu_ps(vrow[j] + d0);
          a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + j), v0, a0);
          b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + j), v0, b0);
        }
        _mm256_storeu_ps(oa + d0, a0);
        if (pair) _mm256_storeu_ps(ob + d0, b0);
      }
    }
  }

  for (int64_t t = 0; t < nt; ++t) {
    for (int64_t h = 0; h < group; ++h) {
      const int64_t nidx = t * group + h;
      const float inv = 1.f / l[nidx];  // every query sees at least its own key: l > 0
      float* dst = out + (q_start + job.t0 + t) * o_row_stride + (job.kv_head * group + h) * o_head_stride;
      const float* on = o + nidx * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = on[d] * inv;
    }
  }
}

// ---- AVX-512F (checked at run time; see raytp::use_avx512), head_dim 64 or 128: the same work item
// with the 16 query positions of one head across the lanes of a vector. Scores are one vector per
// key (s_j[t] = q_t . k_j: a q column load and a broadcast-FMA per dimension), so the causal mask is
// a lane mask per key and the online softmax is all vertical (no horizontal max or sum); P V keeps 16
// dimensions of o per vector, fed by broadcasts of V. The tile's 16 K and V rows are first copied side
// by side (compile-time offsets from one pointer; head_dim is a template parameter for that).
template <int D>
RAYTP_AVX512 void run_job_avx512(const Job& job, const float* query, const float* key_cache, const float* value_cache,
                                 const int32_t* block_table, int64_t q_start, int64_t q_len, int64_t seq_len,
                                 int64_t q_row_stride, int64_t q_head_stride, int64_t o_row_stride,
                                 int64_t o_head_stride, int64_t num_heads, int64_t num_kv_heads, int64_t,
                                 int64_t block_size, float scale, int64_t window, float cap, float* out,
                                 std::vector<float>& scratch) {
  constexpr int64_t T = 16;  // lanes: query positions (kQueryTile), and keys per tile (kKeyTile)
  static_assert(kQueryTile == T && kKeyTile == T, "one vector of positions, one of keys");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t nt = job.t1 - job.t0;
  const int64_t ctx = seq_len - q_len;
  const int64_t token_stride = num_kv_heads * D;
  // qT, oT [group][D][T]; kb, vb [T][D]; p [T keys][T]; m, l [group][T].
  scratch.resize(static_cast<size_t>(2 * group * D * T + 2 * T * D + T * T + 2 * group * T) + 16);
  float* qT = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* oT = qT + group * D * T;
  float* kb = oT + group * D * T;
  float* vb = kb + T * D;
  float* p = vb + T * D;
  float* m = p + T * T;
  float* l = m + group * T;
  // Lanes past the item's last position repeat it (computed, never stored), so every lane sees key 0.
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      const float* src = query + (q_start + job.t0 + std::min(t, nt - 1)) * q_row_stride +
                         (job.kv_head * group + h) * q_head_stride;
      for (int64_t d = 0; d < D; ++d) qT[(h * D + d) * T + t] = src[d] * scale;
    }
  }
  std::fill(oT, oT + group * D * T, 0.f);
  std::fill(m, m + group * T, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group * T, 0.f);
  const __m512i pos = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int32_t>(ctx + job.t0)),
      _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_epi32(static_cast<int32_t>(nt - 1))));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  const int64_t w = window > 0 ? std::min(window, seq_len) : seq_len;  // as in run_job (and fits int32 lanes)
  const __m512 cap_v = _mm512_set1_ps(cap), two_over_cap = _mm512_set1_ps(cap > 0.f ? 2.f / cap : 0.f);
  const int64_t key_end = ctx + job.t1;
  for (int64_t k0 = key_range_begin(job, ctx, w); k0 < key_end; k0 += T) {
    const int64_t nk = std::min(T, key_end - k0);
    __mmask16 vis[T];  // lanes whose window holds key k0 + j: k0 + j <= position < k0 + j + w; none for padding
    for (int64_t j = 0; j < T; ++j) {
      const int64_t pos_j = k0 + std::min(j, nk - 1);  // padding keys repeat the last one (masked off)
      const int64_t slot = static_cast<int64_t>(block_table[pos_j / block_size]) * block_size + pos_j % block_size;
      const float* ks = key_cache + slot * token_stride + job.kv_head * D;
      const float* vs = value_cache + slot * token_stride + job.kv_head * D;
#pragma GCC unroll 8
      for (int64_t d = 0; d < D; d += 16) {
        _mm512_store_ps(kb + j * D + d, _mm512_loadu_ps(ks + d));
        _mm512_store_ps(vb + j * D + d, _mm512_loadu_ps(vs + d));
      }
      vis[j] = j < nk ? _mm512_mask_cmplt_epi32_mask(
                            _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(k0 + j))), pos,
                            _mm512_set1_epi32(static_cast<int32_t>(k0 + j + w)))
                      : 0;
    }
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = qT + h * D * T;
      __m512 s[T];
      // Two halves of 8 keys: 8 accumulators, 8 broadcast sources from one pointer.
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m512 a[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
        const float* kh = kb + half * 8 * D;
#pragma GCC unroll 4
        for (int64_t d = 0; d < D; ++d) {
          const __m512 qv = _mm512_load_ps(qh + d * T);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) a[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kh[j * D + d]), a[j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) s[half * 8 + j] = a[j];
      }
      if (cap > 0.f) {
#pragma GCC unroll 16
        for (int j = 0; j < T; ++j) s[j] = raytp::soft_cap16(s[j], cap_v, two_over_cap);
      }
      // Online softmax, vertical: masked keys are -inf for the max and exactly 0 as weights.
      __m512 mt = neg_inf;
#pragma GCC unroll 16
      for (int j = 0; j < T; ++j) mt = _mm512_max_ps(mt, _mm512_mask_mov_ps(neg_inf, vis[j], s[j]));
      const __m512 m_old = _mm512_load_ps(m + h * T);
      // A lane may have seen no key yet (m = -inf: a window starts after the item's first tile): its
      // corr is exactly 0 (o and l are still 0), never exp(-inf - -inf).
      const __m512 m_new = _mm512_max_ps(m_old, mt);
      const __mmask16 seen = _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ);
      const __m512 corr = _mm512_maskz_mov_ps(seen, raytp::exp16(_mm512_sub_ps(m_old, m_new)));
      __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int j = 0; j < T; ++j) {
        const __m512 e = _mm512_maskz_mov_ps(vis[j], raytp::exp16(_mm512_sub_ps(s[j], m_new)));
        _mm512_store_ps(p + j * T, e);
        sum = _mm512_add_ps(sum, e);
      }
      _mm512_store_ps(m + h * T, m_new);
      _mm512_store_ps(l + h * T, _mm512_fmadd_ps(_mm512_load_ps(l + h * T), corr, sum));
      // o[d] = o[d] * corr + sum_j p_j v_j[d], 16 dimensions at a time.
      float* oh = oT + h * D * T;
#pragma GCC unroll 1
      for (int64_t c = 0; c < D; c += 16) {
        __m512 a[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) a[i] = _mm512_mul_ps(_mm512_load_ps(oh + (c + i) * T), corr);
        for (int64_t j = 0; j < nk; ++j) {
          const __m512 pj = _mm512_load_ps(p + j * T);
          const float* vj = vb + j * D + c;
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(pj, _mm512_set1_ps(vj[i]), a[i]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) _mm512_store_ps(oh + (c + i) * T, a[i]);
      }
    }
  }

  alignas(64) float inv[T];
  for (int64_t h = 0; h < group; ++h) {
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_load_ps(l + h * T)));
    const float* oh = oT + h * D * T;
    for (int64_t t = 0; t < nt; ++t) {
      float* dst = out + (q_start + job.t0 + t) * o_row_stride + (job.kv_head * group + h) * o_head_stride;
      for (int64_t d = 0; d < D; ++d) dst[d] = oh[d * T + t] * inv[t];
    }
  }
}

#endif  // AVX2 + FMA

void paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, int64_t first_row, double scale, int64_t window,
                             double soft_cap, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "caches must be [blocks, bs, kv_heads, d]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  key_cache.scalar_type() == at::kFloat && value_cache.scalar_type() == at::kFloat,
              "paged_prefill_attention is fp32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_tables.stride(1) == 1 && seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "the caches must be contiguous, and query's and out's last dimension");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "cache head_dim differs from the query's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t rows = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == rows + 1 && block_tables.size(0) >= rows, "one start, table and length per row");
  TORCH_CHECK(first_row >= 0 && first_row <= rows, "first_row out of range");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "window and soft_cap must be >= 0 (0: none)");
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  std::vector<Job> jobs;
  for (int64_t r = first_row; r < rows; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r];
    TORCH_CHECK(q_len >= 1 && q_len <= lens[r] && lens[r] <= max_blocks * block_size, "row ", r,
                ": query length / seq_len out of range");
    TORCH_CHECK(starts[r + 1] <= query.size(0), "query_start_loc past the query tokens");
    for (int64_t g = 0; g < num_kv_heads; ++g)
      for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile) jobs.push_back({r, g, t0, std::min(q_len, t0 + kQueryTile)});
  }
  // Longest items first (by the keys they read): a thread that finishes early then takes the short ones.
  const auto keys_read = [&](const Job& job) {
    const int64_t ctx = lens[job.row] - (starts[job.row + 1] - starts[job.row]);
    return ctx + job.t1 - key_range_begin(job, ctx, window > 0 ? window : lens[job.row]);
  };
  std::stable_sort(jobs.begin(), jobs.end(), [&](const Job& a, const Job& b) { return keys_read(a) > keys_read(b); });
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  float* o = out.data_ptr<float>();
  // Items are pulled from a shared counter, not split into fixed ranges: their costs differ by the
  // number of keys they read, and a thread descheduled by another process must not hold a range.
  std::atomic<int64_t> next{0};
  const int64_t num_jobs = static_cast<int64_t>(jobs.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_jobs);
  const auto run = !raytp::use_avx512() ? run_job
                   : head_dim == 64      ? run_job_avx512<64>
                   : head_dim == 128     ? run_job_avx512<128>
                                         : run_job;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < num_jobs; i = next++) {
      const Job& job = jobs[i];
      const int64_t r = job.row;
      run(job, q, kc, vc, tables + r * table_stride, starts[r], starts[r + 1] - starts[r], lens[r], query.stride(0),
          query.stride(1), out.stride(0), out.stride(1), num_heads, num_kv_heads, head_dim, block_size,
          static_cast<float>(scale), window, static_cast<float>(soft_cap), o, scratch);
    }
  });
#else
  TORCH_CHECK(false, "paged_prefill_attention needs the AVX2 + FMA build (ops/attention/cpu_kernels.vectorized())");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, int first_row, float scale, int window, float soft_cap, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
