// Paged decode attention on the CPU: one query token per row, keys and values read in place from
// the paged cache. No gather into a padded buffer, no mask: each row touches exactly its own
// seq_len keys and values, once, whatever the other rows' lengths.
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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Lanes of the partial sums in `dot`: one 512-bit or two 256-bit vectors after auto-vectorisation.
constexpr int64_t kLanes = 16;
// Work below this many (cached token, kv head) pairs runs single-threaded (see the parallel_for):
// ~60 ns each on one thread here, so ~0.1 ms at most, about what a parallel region costs on a busy machine.
constexpr int64_t kMinParallelTokens = 2048;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float s = 0.f;
  for (; d < n; ++d) s += a[d] * b[d];
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

// Asks for a whole block (the next one a row reads; blocks are scattered, so no prefetcher can guess it).
inline void prefetch_block(const float* p, int64_t floats) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < floats * static_cast<int64_t>(sizeof(float)); off += 64) __builtin_prefetch(c + off);
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            const at::Tensor& out) {
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
  for (int64_t r = 0; r < rows; ++r) work += lens[r];
  const int64_t threads = work * num_kv_heads < kMinParallelTokens ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> q(vecs * head_dim), acc(vecs * head_dim), inv_sum(vecs), scores;
    for (int64_t item = next_item++; item < num_items; item = next_item++) {
      const int64_t r = item / splits, h0 = (item % splits) * heads_per_item;
      const int64_t len = lens[r];
      const int32_t* table = tables + r * table_row;
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      // Query vector j = (head h0 + j / group, its j % group-th query head), pre-scaled.
      for (int64_t j = 0; j < vecs; ++j) {
        const float* src = q_base + r * q_row + (h0 * group + j) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) q[j * head_dim + d] = src[d] * fscale;
      }
      scores.resize(vecs * len);
      // Pass 1: scores[j * len + t] = q_j . k_t(head of j)
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        const float* kb = k_base + static_cast<int64_t>(table[b]) * block_stride + h0 * head_dim;
        if (b + 1 < num_blocks) prefetch_block(k_base + static_cast<int64_t>(table[b + 1]) * block_stride, block_stride);
        for (int64_t i = 0; i < n; ++i) {
          const float* k = kb + i * token_stride;
          for (int64_t j = 0; j < vecs; ++j) {
            scores[j * len + t0 + i] = dot(q.data() + j * head_dim, k + (j / group) * head_dim, head_dim);
          }
        }
      }
      for (int64_t j = 0; j < vecs; ++j) {
        float* sc = scores.data() + j * len;
        const float m = *std::max_element(sc, sc + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        inv_sum[j] = 1.f / sum;
      }
      // Pass 2: acc_j = sum_t p_j(t) v_t(head of j)
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t t0 = b * block_size, n = std::min(block_size, len - t0);
        const float* vb = v_base + static_cast<int64_t>(table[b]) * block_stride + h0 * head_dim;
        if (b + 1 < num_blocks) prefetch_block(v_base + static_cast<int64_t>(table[b + 1]) * block_stride, block_stride);
        for (int64_t i = 0; i < n; ++i) {
          const float* v = vb + i * token_stride;
          for (int64_t j = 0; j < vecs; ++j) {
            axpy(scores[j * len + t0 + i], v + (j / group) * head_dim, acc.data() + j * head_dim, head_dim);
          }
        }
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
      "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
