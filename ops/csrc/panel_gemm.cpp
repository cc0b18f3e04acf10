// y = x W^T for a few rows of x (a decode step of one to a few sequences), W prepacked in panels.
//
// With one token per step a linear layer is a matrix-vector product: its time is the time to stream
// W from memory once. oneDNN's packed GEMM streams ~12 GB/s per core for one row on this project's
// AMD machines (MKL ~10); this loop reads W at what the memory delivers, because the panel layout
// makes the whole read one sequential stream and needs no horizontal sums: W [N, K] is stored as
// [ceil(N / 16), K, 16] (16 output features side by side for every input feature; the last panel
// zero-padded), and each x value is broadcast against one 16-wide row of its panel.
// model_exec/layers/cpu_gemm.py holds the measured crossover batch size above which oneDNN wins.
//
// Layouts: x [M, K] with a contiguous last dim, panels [G, K, 16] contiguous, out [M, N] fresh, fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: two AVX2 vectors
// Panels per parallel chunk at least: 4 panels of K=576 are 147 KB of W, ~10 us on one core.
constexpr int64_t kGrain = 4;

#if defined(__AVX2__) && defined(__FMA__)
// out[m * ldo + c] = x_m . W[c] for MB rows of x and the panel's `cols` (<= 16) features. U
// accumulator sets over consecutive k split the FMA dependency chains when MB alone gives too few
// (2 x MB x U accumulators must stay within the 16 vector registers with W and x beside them).
template <int MB, int U>
inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t k_len, float* out, int64_t ldo,
                       int64_t cols) {
  __m256 a[U][MB][2];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MB; ++m) a[u][m][0] = a[u][m][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + U <= k_len; k += U) {
    for (int u = 0; u < U; ++u) {
      const float* wk = w + (k + u) * kPanel;
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      for (int m = 0; m < MB; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k + u);
        a[u][m][0] = _mm256_fmadd_ps(xb, w0, a[u][m][0]);
        a[u][m][1] = _mm256_fmadd_ps(xb, w1, a[u][m][1]);
      }
    }
  }
  for (; k < k_len; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
    for (int m = 0; m < MB; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      a[0][m][0] = _mm256_fmadd_ps(xb, w0, a[0][m][0]);
      a[0][m][1] = _mm256_fmadd_ps(xb, w1, a[0][m][1]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int u = 1; u < U; ++u) {
      a[0][m][0] = _mm256_add_ps(a[0][m][0], a[u][m][0]);
      a[0][m][1] = _mm256_add_ps(a[0][m][1], a[u][m][1]);
    }
    alignas(32) float row[kPanel];
    _mm256_store_ps(row, a[0][m][0]);
    _mm256_store_ps(row + 8, a[0][m][1]);
    std::copy(row, row + cols, out + m * ldo);
  }
}
#endif

void panel_rows_scalar(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t k_len, float* out,
                       int64_t ldo, int64_t cols) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t c = 0; c < cols; ++c) {
      float s = 0.f;
      for (int64_t k = 0; k < k_len; ++k) s += x[m * ldx + k] * w[k * kPanel + c];
      out[m * ldo + c] = s;
    }
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel, "x [M, K] and panels [G, K, 16] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "panel_linear runs on float32");
  TORCH_CHECK(x.stride(1) == 1 && panels.is_contiguous(), "x needs a contiguous last dim, panels must be contiguous");
  const int64_t rows = x.size(0), k_len = x.size(1), groups = panels.size(0);
  TORCH_CHECK(panels.size(1) == k_len, "x has ", k_len, " features, the panels ", panels.size(1));
  TORCH_CHECK(out_features > (groups - 1) * kPanel && out_features <= groups * kPanel, "out_features does not match the panels");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, groups, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* w = wp + g * k_len * kPanel;
      float* o = op + g * kPanel;
      const int64_t cols = std::min(kPanel, out_features - g * kPanel);
#if defined(__AVX2__) && defined(__FMA__)
      // Pairs of rows: 8 accumulators (U = 2) plus W and x fit the 16 vector registers.
      int64_t m = 0;
      for (; m + 2 <= rows; m += 2) panel_rows<2, 2>(xp + m * ldx, ldx, w, k_len, o + m * out_features, out_features, cols);
      if (m < rows) panel_rows<1, 2>(xp + m * ldx, ldx, w, k_len, o + m * out_features, out_features, cols);
#else
      panel_rows_scalar(xp, ldx, rows, w, k_len, o, out_features, cols);
#endif
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) { m.def("panel_linear(Tensor x, Tensor panels, int out_features) -> Tensor"); }

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("panel_linear", &panel_linear); }
