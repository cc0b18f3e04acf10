// Fused CPU kernels for a decoder layer's small elementwise steps: RMSNorm (with and without the
// residual add), rotate-half rotary embedding in place, and SiLU-and-mul. Each replaces a chain of
// 3-8 torch ops (each its own dispatch, its own pass over memory, its own temporary) with one pass.
// Names and in-place semantics follow vLLM's CPU ops; fp32 only; the Python wrappers in
// ops/fused.py decide when they apply, and the torch code in model_exec/layers stays the reference.
//
// Rows: every op works on "rows" of the last dimension (any leading shape that views as
// [rows, cols] with a contiguous last dim). Rows are split over threads only when a call covers at
// least kParallelElems output floats: a single stream's decode row (or a few) stays on the calling
// thread, where waking the pool would cost more than the work.
//
// Numerics against the torch reference (tests/ops/test_fused_layers.py):
//  - residual add and rotary are bit-identical (the same single-rounding mul/sub/add sequence; an
//    empty asm keeps the compiler from contracting a*c - b*s into an FMA, which rounds once less);
//  - RMSNorm sums the squares in another order (8 lanes x 4 accumulators), so it differs from
//    torch's mean by float rounding (a few ulp);
//  - SiLU uses a Cephes-style exp polynomial (about 1 ulp) where torch uses Sleef's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#define RAYTP_FUSED_AVX2 1
#endif

namespace {

// Calls producing fewer floats than this run on the calling thread; it is torch's own grain
// (at::internal::GRAIN_SIZE), so a fused op is never serial where the torch ops it replaces were
// split. At 64K, SiLU-and-mul over an offline decode window (~24 rows x 1536) ran on one thread
// and lost to torch's two-thread silu (26 vs ~19 us + the mul). The price on a shared machine: a
// parallel region waits for whichever OpenMP thread another process has descheduled (seen: ~8 ms
// for 16 rows split in two), the same stall every torch op above the grain pays.
constexpr int64_t kParallelElems = 32768;

template <typename F>
void for_rows(int64_t rows, int64_t cols, const F& body) {
  const int64_t grain = std::max<int64_t>(1, kParallelElems / std::max<int64_t>(cols, 1));
  if (rows <= grain) {
    body(0, rows);
    return;
  }
  at::parallel_for(0, rows, grain, body);
}

// Keeps `v` opaque to the optimiser, so a product is rounded before the add that follows it (x86:
// an SSE/AVX register operand; elsewhere no barrier, and exactness there is not claimed).
template <typename T>
inline T rounded(T v) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(v));
#endif
  return v;
}

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " needs a contiguous last dimension");
}

// [rows, cols] view of t (throws if its leading dims do not collapse into one stride).
at::Tensor as_rows(const at::Tensor& t) { return t.view({-1, t.size(-1)}); }

float sum_of_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef RAYTP_FUSED_AVX2
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; i + 32 <= n; i += 32) {
    for (int w = 0; w < 4; ++w) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * w);
      acc[w] = _mm256_fmadd_ps(v, v, acc[w]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  total = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// out = weight * (x * rsqrt(mean(x^2) + eps)): torch's order of operations in model_exec/layers/norm.py.
void norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

void rms_norm(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_float_rows(input, "input");
  check_float_rows(out, "out");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous(),
              "weight must be a contiguous float32 vector");
  TORCH_CHECK(out.sizes() == input.sizes() && weight.size(0) == input.size(-1), "shape mismatch");
  const at::Tensor x = as_rows(input), o = as_rows(out);
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), os = o.stride(0);
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* op = o.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * xs, wp, op + r * os, n, e);
  });
}

// residual = input + residual; input = rms_norm(residual) * weight. Both in place.
void fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_float_rows(input, "input");
  check_float_rows(residual, "residual");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous(),
              "weight must be a contiguous float32 vector");
  TORCH_CHECK(residual.sizes() == input.sizes() && weight.size(0) == input.size(-1), "shape mismatch");
  const at::Tensor x = as_rows(input), res = as_rows(residual);
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = res.stride(0);
  float* xp = x.data_ptr<float>();
  float* rp = res.data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * xs;
      float* rr = rp + r * rs;
      for (int64_t i = 0; i < n; ++i) rr[i] = xr[i] + rr[i];
      norm_row(rr, wp, xr, n, e);
    }
  });
}

// x[:half], x[half:] = x1*cos - x2*sin, x2*cos + x1*sin for one head (rotate-half / GPT-NeoX layout).
void rotate_head(float* x, const float* cos, const float* sin, int64_t half) {
  float* x2 = x + half;
  int64_t i = 0;
#ifdef RAYTP_FUSED_AVX2
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x2 + i);
    const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
    const __m256 ac = rounded(_mm256_mul_ps(a, c)), bs = rounded(_mm256_mul_ps(b, s));
    const __m256 bc = rounded(_mm256_mul_ps(b, c)), as = rounded(_mm256_mul_ps(a, s));
    _mm256_storeu_ps(x + i, _mm256_sub_ps(ac, bs));
    _mm256_storeu_ps(x2 + i, _mm256_add_ps(bc, as));
  }
#endif
  for (; i < half; ++i) {
    const float a = x[i], b = x2[i];
    x[i] = rounded(a * cos[i]) - rounded(b * sin[i]);
    x2[i] = rounded(b * cos[i]) + rounded(a * sin[i]);
  }
}

// qk [tokens, heads, head_dim] (any token/head strides, contiguous last dim) rotated in place;
// cos/sin hold tokens rows of head_dim/2 floats ([tokens, half] or [tokens, 1, half], any row stride).
void rotate_half_rope(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3, "qk must be [tokens, heads, head_dim]");
  check_float_rows(qk, "qk");
  check_float_rows(cos, "cos");
  check_float_rows(sin, "sin");
  const int64_t tokens = qk.size(0), heads = qk.size(1), head_dim = qk.size(2), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->size(0) == tokens && t->size(-1) == half && t->numel() == tokens * half,
                "cos/sin must hold one row of head_dim/2 angles per token");
  }
  float* xp = qk.data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  const int64_t ts = qk.stride(0), hs = qk.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  for_rows(tokens * heads, head_dim, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / heads, h = r % heads;
      rotate_head(xp + t * ts + h * hs, cp + t * cs, sp + t * ss, half);
    }
  });
}


// out[..., :d] = silu(x[..., :d]) * x[..., d:], silu(g) = g / (1 + e^-g) as torch computes it.
void silu_and_mul(const at::Tensor& out, const at::Tensor& input) {
  check_float_rows(input, "input");
  check_float_rows(out, "out");
  const int64_t d = out.size(-1);
  TORCH_CHECK(input.size(-1) == 2 * d && input.numel() == 2 * out.numel(), "input must be [..., 2d], out [..., d]");
  const at::Tensor x = as_rows(input), o = as_rows(out);
  const int64_t rows = x.size(0), xs = x.stride(0), os = o.stride(0);
  const float* xp = x.const_data_ptr<float>();
  float* op = o.data_ptr<float>();
  for_rows(rows, d, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * xs;
      const float* u = g + d;
      float* dst = op + r * os;
      int64_t i = 0;
#ifdef RAYTP_FUSED_AVX2
      for (; i + 8 <= d; i += 8) _mm256_storeu_ps(dst + i, raytp::silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
      for (; i < d; ++i) dst[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
    }
  });
}

}  // namespace

// The library itself is defined (TORCH_LIBRARY) by ops/attention/csrc/paged_decode.cpp, compiled
// into the same shared object by ops/attention/cpu_kernels.py.
TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotate_half_rope(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
}

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotate_half_rope", &rotate_half_rope);
  m.impl("silu_and_mul", &silu_and_mul);
}
