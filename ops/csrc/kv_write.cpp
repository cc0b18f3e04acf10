// Writes a step's new keys and values into the paged KV cache through the slot mapping: the CPU
// version of ops/cache_ops.py's write_to_paged_cache (two index_copy_ calls, ~35 us each per layer
// for a 64-row decode step on this project's machines, most of it dispatch and TensorIterator setup
// for a copy of a few KB).
//
// key/value [T, H, D] with D contiguous and the H heads of a token side by side (a view into the
// fused QKV projection qualifies), caches [num_blocks, block_size, H, D] contiguous, slot_mapping [T]
// int64 (block id * block_size + offset), all fp32. Each token is two copies of H * D floats.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// One token's row into its slot. The slots of a step are scattered over a cache far larger than the
// CPU caches, so an ordinary store first reads each destination line from DRAM (read-for-ownership):
// a 64-row decode step's 138 KB of writes then took ~75 us per layer in the offline workload, latency
// and not bandwidth. Streaming (non-temporal) stores write whole lines without reading them; the
// decode kernel's read of the new token right after is one line per token.
inline void copy_row(float* dst, const float* src, int64_t n) {
#if defined(__AVX2__)
  if (reinterpret_cast<std::uintptr_t>(dst) % 32 == 0 && n % 8 == 0) {
    for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    return;
  }
#endif
  std::memcpy(dst, src, n * sizeof(float));
}

// Below this many tokens (a decode step, a short chunk) the copies stay on the calling thread.
constexpr int64_t kParallelTokens = 256;

void check_rows(const at::Tensor& t, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && cache.scalar_type() == at::kFloat, name, " and its cache must be float32");
  TORCH_CHECK(t.dim() == 3 && cache.dim() == 4 && t.size(1) == cache.size(2) && t.size(2) == cache.size(3), name,
              " must be [T, H, D] and its cache [blocks, block_size, H, D]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name, " needs each token's heads side by side");
  TORCH_CHECK(cache.is_contiguous(), name, "'s cache must be contiguous");
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_rows(key, key_cache, "key");
  check_rows(value, value_cache, "value");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key.size(0) == value.size(0), "key and value disagree");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be [T] int64, one slot per token");
  const int64_t tokens = key.size(0), width = key.size(1) * key.size(2);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const auto copy = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      copy_row(kc + slots[t] * width, k + t * ks, width);
      copy_row(vc + slots[t] * width, v + t * vs, width);
    }
#if defined(__AVX2__)
    _mm_sfence();  // the streamed lines are globally visible before the attention reads them
#endif
  };
  if (tokens < kParallelTokens)
    copy(0, tokens);
  else
    at::parallel_for(0, tokens, kParallelTokens / 2, copy);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("write_kv_cache", &write_kv_cache); }
