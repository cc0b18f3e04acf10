// Paged decode attention on the CPU: one query token per row, keys and values read in place from
// the paged cache. No gather into a padded buffer, no mask: each row touches exactly its own
// seq_len keys and values, once, whatever the other rows' lengths. With a sliding window w
// (`window` > 0) a row reads only its last min(w, seq_len) keys, starting inside the block that
// holds the first of them (the blocks before it are never touched); with `soft_cap` c > 0 the
// scores become c * tanh(score / c) before the softmax (ops/attention/base.py has both semantics).
//
// Layouts (see ops/attention/base.py): query/out [rows, num_heads, head_dim] (last dim contiguous),
// key/value cache [num_blocks, block_size, num_kv_heads, head_dim] contiguous, block_tables
// [rows, max_blocks] int32 (last dim contiguous), seq_lens [rows] int32, all fp32.
//
// Work is split over rows (or (row, kv head) pairs when rows are few); the query heads of one GQA
// group share every K/V read.
// Scores are kept for the whole row (seq_len floats per query head, in a per-thread buffer), then
// softmaxed exactly (max subtracted) and used to accumulate V: the same math as SDPA in another
// summation order.
//
// Three implementations of the inner loops: AVX2 + FMA intrinsics (compiled when the loader passes
// -mavx2 -mfma, used when head_dim is a multiple of 8), AVX-512 ones in the same build (picked at run
// time where the CPU has AVX-512F and head_dim is a multiple of 16; `python -m benchmarks.attention_bench
// --backend cpu --block-size 128`, AVX2 vs AVX-512 in one run on a Zen 5: 64 rows x 512 tokens 1.18 ->
// 0.93 ms, 96 ragged rows 2.17 -> 1.83 ms, about the machine's memory bandwidth now), and portable
// scalar loops for everything else. All are tested against the torch backend.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "../../csrc/vec_math.h"
#endif

namespace {

// Work below this many (cached token, kv head) pairs runs single-threaded (see the parallel_for):
// a few microseconds on one thread, about what waking the pool costs, and far less than a parallel
// region waiting for a thread that another process has descheduled.
constexpr int64_t kMinParallelTokens = 2048;

// One work item's view of the cache: `vecs` query vectors (query heads h0*group .. +vecs) over
// `heads` consecutive KV heads starting at h0; every query vector j reads KV head j / group.
// Asks for `floats` floats from p on (part of the next block a row reads: blocks are scattered, so
// no hardware prefetcher can guess it). Spread over the current block's tokens, one slot at a time,
// so the requests never queue up behind each other.
inline void prefetch(const float* p, int64_t floats) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < floats * static_cast<int64_t>(sizeof(float)); off += 64) __builtin_prefetch(c + off);
}

struct Item {
  const float* q;       // [vecs, head_dim] pre-scaled queries, contiguous
  int64_t heads, group, head_dim;
  int64_t token_stride;  // floats between consecutive slots of a block
};

// ---- Scalar code: any head_dim, any ISA. The AVX2 code below computes the same sums. -------------

// scores[j * ld + i] = q_j . k_i for the n tokens of one block (kb: the block's first slot at head h0).
void block_scores_scalar(const Item& it, const float* kb, const float* next, int64_t n, float* scores, int64_t ld) {
  for (int64_t i = 0; i < n; ++i) {
    if (next != nullptr) prefetch(next + i * it.token_stride, it.heads * it.head_dim);
    const float* k_tok = kb + i * it.token_stride;
    for (int64_t j = 0; j < it.heads * it.group; ++j) {
      const float* k = k_tok + (j / it.group) * it.head_dim;
      const float* q = it.q + j * it.head_dim;
      float s = 0.f;
      for (int64_t d = 0; d < it.head_dim; ++d) s += q[d] * k[d];
      scores[j * ld + i] = s;
    }
  }
}

// acc_j += sum_i p[j * ld + i] v_i for the n tokens of one block.
void block_accumulate_scalar(const Item& it, const float* vb, const float* next, int64_t n, const float* p, int64_t ld,
                             float* acc) {
  for (int64_t i = 0; next != nullptr && i < n; ++i) prefetch(next + i * it.token_stride, it.heads * it.head_dim);
  for (int64_t j = 0; j < it.heads * it.group; ++j) {
    float* a = acc + j * it.head_dim;
    for (int64_t i = 0; i < n; ++i) {
      const float* v = vb + i * it.token_stride + (j / it.group) * it.head_dim;
      const float w = p[j * ld + i];
      for (int64_t d = 0; d < it.head_dim; ++d) a[d] += w * v[d];
    }
  }
}

// sc[t] = cap * tanh(sc[t] / cap): logit soft-capping (Gemma 2).
void soft_cap_scalar(float* sc, int64_t len, float cap) {
  for (int64_t t = 0; t < len; ++t) sc[t] = cap * std::tanh(sc[t] / cap);
}

// sc[t] = exp(sc[t] - max), returns the sum.
float softmax_numerators_scalar(float* sc, int64_t len) {
  const float m = *std::max_element(sc, sc + len);
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    sc[t] = std::exp(sc[t] - m);
    sum += sc[t];
  }
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// ---- AVX2 + FMA: head_dim a multiple of 8 (every model we serve). --------------------------------
// Measured per (cached token, KV head) on one core, SmolLM2 shapes, 64 rows x 512 tokens: with the
// blocks in cache ~51 ns with the scalar loops (horizontal sums per score, scalar expf, the
// accumulator reloaded per token) vs ~16 ns here; from a cold 48 MB pool on two cores the call went
// 4.6 -> 2.8 ms (~18 GB/s of K and V: memory-bound now).
constexpr bool kHaveAvx2 = true;

// NJ query vectors (consecutive, head_dim apart) against one key; two accumulators per vector so the
// FMA chains are half as long.
template <int NJ>
inline void dots(const float* q, const float* k, int64_t head_dim, float* out, int64_t ld) {
  __m256 a0[NJ], a1[NJ];
  for (int j = 0; j < NJ; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= head_dim; d += 16) {
    const __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + d + 8);
    for (int j = 0; j < NJ; ++j) {
      a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * head_dim + d), k0, a0[j]);
      a1[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * head_dim + d + 8), k1, a1[j]);
    }
  }
  if (d < head_dim) {  // head_dim % 16 == 8
    const __m256 k0 = _mm256_loadu_ps(k + d);
    for (int j = 0; j < NJ; ++j) a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * head_dim + d), k0, a0[j]);
  }
  for (int j = 0; j < NJ; ++j) out[j * ld] = raytp::hsum8(_mm256_add_ps(a0[j], a1[j]));
}

void block_scores_avx2(const Item& it, const float* kb, const float* next, int64_t n, float* scores, int64_t ld) {
  for (int64_t i = 0; i < n; ++i) {
    if (next != nullptr) prefetch(next + i * it.token_stride, it.heads * it.head_dim);
    const float* k_tok = kb + i * it.token_stride;
    for (int64_t h = 0; h < it.heads; ++h) {
      const float* k = k_tok + h * it.head_dim;
      for (int64_t j0 = h * it.group, end = j0 + it.group; j0 < end; j0 += 4) {
        const float* q = it.q + j0 * it.head_dim;
        float* out = scores + j0 * ld + i;
        switch (std::min<int64_t>(4, end - j0)) {
          case 4: dots<4>(q, k, it.head_dim, out, ld); break;
          case 3: dots<3>(q, k, it.head_dim, out, ld); break;
          case 2: dots<2>(q, k, it.head_dim, out, ld); break;
          default: dots<1>(q, k, it.head_dim, out, ld); break;
        }
      }
    }
  }
}

// W accumulator vectors (8*W dims of one query vector) kept in registers over a block's tokens.
// `next`, when given, is prefetched a slot per token (`next_floats` each).
template <int W>
inline void accumulate_span(const float* p, const float* v, int64_t n, int64_t token_stride, float* a,
                            const float* next, int64_t next_floats) {
  __m256 s[W];
  for (int w = 0; w < W; ++w) s[w] = _mm256_loadu_ps(a + 8 * w);
  for (int64_t i = 0; i < n; ++i) {
    if (next != nullptr) prefetch(next + i * token_stride, next_floats);
    const __m256 weight = _mm256_set1_ps(p[i]);
    for (int w = 0; w < W; ++w) s[w] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + i * token_stride + 8 * w), s[w]);
  }
  for (int w = 0; w < W; ++w) _mm256_storeu_ps(a + 8 * w, s[w]);
}

void block_accumulate_avx2(const Item& it, const float* vb, const float* next, int64_t n, const float* p, int64_t ld,
                           float* acc) {
  const int64_t slot = it.heads * it.head_dim;
  for (int64_t j = 0; j < it.heads * it.group; ++j) {
    const float* v = vb + (j / it.group) * it.head_dim;
    float* a = acc + j * it.head_dim;
    int64_t d = 0;
    for (; d + 32 <= it.head_dim; d += 32) {
      accumulate_span<4>(p + j * ld, v + d, n, it.token_stride, a + d, j == 0 && d == 0 ? next : nullptr, slot);
    }
    for (; d < it.head_dim; d += 8) {
      accumulate_span<1>(p + j * ld, v + d, n, it.token_stride, a + d, j == 0 && d == 0 ? next : nullptr, slot);
    }
  }
}

void soft_cap_avx2(float* sc, int64_t len, float cap) {
  const __m256 c = _mm256_set1_ps(cap), two_over_c = _mm256_set1_ps(2.f / cap);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) _mm256_storeu_ps(sc + t, raytp::soft_cap8(_mm256_loadu_ps(sc + t), c, two_over_c));
  for (; t < len; ++t) sc[t] = cap * std::tanh(sc[t] / cap);
}

float softmax_numerators_avx2(float* sc, int64_t len) {
  int64_t t = 0;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + t));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
  for (; t < len; ++t) m = std::max(m, sc[t]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = raytp::exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mb));
    _mm256_storeu_ps(sc + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = raytp::hsum8(sv);
  for (; t < len; ++t) {
    sc[t] = std::exp(sc[t] - m);
    sum += sc[t];
  }
  return sum;
}

// ---- AVX-512F (run-time check, raytp::use_avx512), head_dim a multiple of 16: the same sums with
// 512-bit vectors. Scores: one K load per 16 dimensions feeds every query vector of the KV head.
// P V: all query vectors of a KV head (up to 4 at a time) accumulate 64 dimensions each in
// registers over the block's tokens, so each V load feeds every query vector of the group (the AVX2
// code above reloads V once per query vector).
template <int NJ>
RAYTP_AVX512 inline void dots512(const float* q, const float* k, int64_t head_dim, float* out, int64_t ld) {
  __m512 a[NJ];
#pragma GCC unroll 4
  for (int j = 0; j < NJ; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512 kv = _mm512_loadu_ps(k + d);
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * head_dim + d), kv, a[j]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < NJ; ++j) out[j * ld] = _mm512_reduce_add_ps(a[j]);
}

// block_scores_avx2's loop around dots512. A separate function, not a template shared with it: the
// target attribute (needed for dots512 to inline) cannot depend on a template parameter.
RAYTP_AVX512 void block_scores_avx512(const Item& it, const float* kb, const float* next, int64_t n, float* scores,
                                      int64_t ld) {
  for (int64_t i = 0; i < n; ++i) {
    if (next != nullptr) prefetch(next + i * it.token_stride, it.heads * it.head_dim);
    const float* k_tok = kb + i * it.token_stride;
    for (int64_t h = 0; h < it.heads; ++h) {
      const float* k = k_tok + h * it.head_dim;
      for (int64_t j0 = h * it.group, end = j0 + it.group; j0 < end; j0 += 4) {
        const float* q = it.q + j0 * it.head_dim;
        float* out = scores + j0 * ld + i;
        switch (std::min<int64_t>(4, end - j0)) {
          case 4: dots512<4>(q, k, it.head_dim, out, ld); break;
          case 3: dots512<3>(q, k, it.head_dim, out, ld); break;
          case 2: dots512<2>(q, k, it.head_dim, out, ld); break;
          default: dots512<1>(q, k, it.head_dim, out, ld); break;
        }
      }
    }
  }
}

// acc_j[d0, d0 + 16 W) += sum_i p_j[i] v_i for NJ query vectors j (p_j = p + j * ld, acc_j = a + j * head_dim).
template <int NJ, int W>
RAYTP_AVX512 inline void accumulate512(const float* p, int64_t ld, const float* v, int64_t n, int64_t token_stride,
                                       float* a, int64_t head_dim, const float* next, int64_t next_floats) {
  __m512 s[NJ][W];
#pragma GCC unroll 4
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) s[j][w] = _mm512_loadu_ps(a + j * head_dim + 16 * w);
  for (int64_t i = 0; i < n; ++i) {
    if (next != nullptr) prefetch(next + i * token_stride, next_floats);
    __m512 vv[W];
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) vv[w] = _mm512_loadu_ps(v + i * token_stride + 16 * w);
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) {
      const __m512 weight = _mm512_set1_ps(p[j * ld + i]);
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w) s[j][w] = _mm512_fmadd_ps(weight, vv[w], s[j][w]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(a + j * head_dim + 16 * w, s[j][w]);
}

template <int NJ>
RAYTP_AVX512 inline void accumulate512_dims(const float* p, int64_t ld, const float* v, int64_t n, int64_t token_stride,
                                            float* a, int64_t head_dim, const float* next, int64_t next_floats) {
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64, next = nullptr)
    accumulate512<NJ, 4>(p, ld, v + d, n, token_stride, a + d, head_dim, next, next_floats);
  for (; d < head_dim; d += 16, next = nullptr)
    accumulate512<NJ, 1>(p, ld, v + d, n, token_stride, a + d, head_dim, next, next_floats);
}

RAYTP_AVX512 void block_accumulate_avx512(const Item& it, const float* vb, const float* next, int64_t n, const float* p,
                                          int64_t ld, float* acc) {
  const int64_t slot = it.heads * it.head_dim;
  for (int64_t h = 0; h < it.heads; ++h) {
    const float* v = vb + h * it.head_dim;
    for (int64_t j0 = h * it.group, end = j0 + it.group; j0 < end; j0 += 4) {
      const float* pj = p + j0 * ld;
      float* a = acc + j0 * it.head_dim;
      const float* pre = h == 0 && j0 == 0 ? next : nullptr;
      switch (std::min<int64_t>(4, end - j0)) {
        case 4: accumulate512_dims<4>(pj, ld, v, n, it.token_stride, a, it.head_dim, pre, slot); break;
        case 3: accumulate512_dims<3>(pj, ld, v, n, it.token_stride, a, it.head_dim, pre, slot); break;
        case 2: accumulate512_dims<2>(pj, ld, v, n, it.token_stride, a, it.head_dim, pre, slot); break;
        default: accumulate512_dims<1>(pj, ld, v, n, it.token_stride, a, it.head_dim, pre, slot); break;
      }
    }
  }
}
inline bool have_avx512() { return raytp::use_avx512(); }
#else
constexpr bool kHaveAvx2 = false;
inline bool have_avx512() { return false; }
void block_scores_avx2(const Item&, const float*, const float*, int64_t, float*, int64_t) {}
void block_accumulate_avx2(const Item&, const float*, const float*, int64_t, const float*, int64_t, float*) {}
void block_scores_avx512(const Item&, const float*, const float*, int64_t, float*, int64_t) {}
void block_accumulate_avx512(const Item&, const float*, const float*, int64_t, const float*, int64_t, float*) {}
float softmax_numerators_avx2(float*, int64_t) { return 0.f; }
void soft_cap_avx2(float*, int64_t, float) {}
#endif

void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                            double soft_cap, const at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [rows, heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "caches must be [blocks, bs, kv_heads, d]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  key_cache.scalar_type() == at::kFloat && value_cache.scalar_type() == at::kFloat,
              "paged_decode_attention runs on float32 tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "query/out/block_tables need a contiguous last dimension");
  const int64_t rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "cache head_dim differs from the query's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "window and soft_cap must be >= 0 (0: none)");
  TORCH_CHECK(block_tables.size(0) >= rows && seq_lens.size(0) >= rows, "one block table and seq_len per row");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= max_blocks * block_size, "seq_len out of the block table's range");
  }
  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const float* k_base = key_cache.data_ptr<float>();
  const float* v_base = value_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t table_row = block_tables.stride(0);
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of a block
  const int64_t block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

  // A work item is a row, or one KV head of a row when there are too few rows to keep every thread
  // busy. Whole rows read each cached token's K (and V) for all heads as one contiguous run, which
  // the hardware prefetchers follow; one head at a time reads 1/num_kv_heads of every run (measured
  // 4x slower per byte).
  const int64_t splits = rows >= 4 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_item = num_kv_heads / splits;
  const int64_t vecs = heads_per_item * group;  // query vectors per item
  // Rows differ in length, so threads take items one at a time from a shared counter instead of
  // parallel_for's equal static ranges.
  // Below kMinParallelTokens cached (token, kv head) pairs the whole call takes microseconds: it runs on
  // the calling thread, since waking the pool costs as much, and far more when another process holds
  // a core (a parallel region then waits for a descheduled thread).
  const int64_t num_items = rows * splits;
  int64_t work = 0;
  for (int64_t r = 0; r < rows; ++r) work += window > 0 ? std::min<int64_t>(lens[r], window) : lens[r];
  const int64_t threads = work * num_kv_heads < kMinParallelTokens ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  const bool avx2 = kHaveAvx2 && head_dim % 8 == 0;
  const bool avx512 = kHaveAvx2 && head_dim % 16 == 0 && have_avx512();
  const auto block_scores = avx512 ? block_scores_avx512 : avx2 ? block_scores_avx2 : block_scores_scalar;
  const auto block_accumulate = avx512 ? block_accumulate_avx512 : avx2 ? block_accumulate_avx2 : block_accumulate_scalar;
  const auto softmax_numerators = avx2 ? softmax_numerators_avx2 : softmax_numerators_scalar;
  const auto apply_soft_cap = avx2 ? soft_cap_avx2 : soft_cap_scalar;
  const float cap = static_cast<float>(soft_cap);
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> q(vecs * head_dim), acc(vecs * head_dim), inv_sum(vecs), scores;
    const Item it{q.data(), heads_per_item, group, head_dim, token_stride};
    for (int64_t item = next_item++; item < num_items; item = next_item++) {
      const int64_t r = item / splits, h0 = (item % splits) * heads_per_item;
      // The row's query sits at position lens[r] - 1 and attends keys [first, lens[r]): with a window,
      // blocks wholly before `first` are never read, and the first one read is entered part-way.
      const int64_t end = lens[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      const int64_t len = end - first;
      const int32_t* table = tables + r * table_row;
      const int64_t b0 = first / block_size, b1 = (end + block_size - 1) / block_size;
      // Query vector j = (head h0 + j / group, its j % group-th query head), pre-scaled.
      for (int64_t j = 0; j < vecs; ++j) {
        const float* src = q_base + r * q_row + (h0 * group + j) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) q[j * head_dim + d] = src[d] * fscale;
      }
      // scores[j * len + t - first]: query vector j against cached token t, then its softmax numerator.
      scores.resize(vecs * len);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t t0 = std::max(b * block_size, first), n = std::min((b + 1) * block_size, end) - t0;
        const int64_t in_block = (t0 - b * block_size) * token_stride + h0 * head_dim;
        block_scores(it, k_base + static_cast<int64_t>(table[b]) * block_stride + in_block,
                     b + 1 < b1 ? k_base + static_cast<int64_t>(table[b + 1]) * block_stride + h0 * head_dim : nullptr,
                     n, scores.data() + t0 - first, len);
      }
      if (cap > 0.f) {
        for (int64_t j = 0; j < vecs; ++j) apply_soft_cap(scores.data() + j * len, len, cap);
      }
      for (int64_t j = 0; j < vecs; ++j) inv_sum[j] = 1.f / softmax_numerators(scores.data() + j * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t t0 = std::max(b * block_size, first), n = std::min((b + 1) * block_size, end) - t0;
        const int64_t in_block = (t0 - b * block_size) * token_stride + h0 * head_dim;
        block_accumulate(it, v_base + static_cast<int64_t>(table[b]) * block_stride + in_block,
                         b + 1 < b1 ? v_base + static_cast<int64_t>(table[b + 1]) * block_stride + h0 * head_dim : nullptr,
                         n, scores.data() + t0 - first, len, acc.data());
      }
      for (int64_t j = 0; j < vecs; ++j) {
        float* dst = o_base + r * o_row + (h0 * group + j) * o_head;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[j * head_dim + d] * inv_sum[j];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(raytp_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, float soft_cap, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
