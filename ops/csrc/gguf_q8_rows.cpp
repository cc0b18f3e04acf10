// Q8_0 blocks (fp16 d, 32 x int8) against quantized rows of x: the LM head of the Q4_1 / Q4_0 GGUF files and
// every layer of `quantization="int8"` on the integer road, at every row count.
//
// Why its own tile (measured, docs/benchmarks.md): a Q8_0 block pair is 68 bytes, more than the one 64-byte load
// the Q4 pair tiles of gguf_gemm.cpp are built on, so their pair layout cost Q8_0 two loads, three lane permutes
// and two scalar fp16 conversions per pair on top of the dot, about 20 vector uops per 64 weights. Here a block
// is one 256-bit vpdpbusd on the block's bytes as stored (|w| against x with w's sign: vpdpbusd multiplies
// unsigned by signed bytes), and the 16 scales of 16 blocks come in one gather and one vcvtph2ps, are multiplied
// by x's 16 grid steps at once, and each block's FMA takes its scale as a broadcast from memory: ~5 vector uops
// per block. Four accumulators in turn keep the FMA latency off the critical path.
//
// Up to four rows share each block's load, and each row's float sums run in one order whatever the rows beside it
// (a row's logits must not follow its neighbours': model_exec/layers/quantization/row_roads.py). The integer dots
// are gguf_gemm.cpp's (the same bytes in the same int32 sums), only the float sums over blocks run in another
// order than its AVX2 tiles, so results agree with them to float32 rounding (tests/ops/test_gguf_gemm.py).
#include "gguf_q8_rows.h"

#include <c10/util/Exception.h>

#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace raytp {

#if defined(__AVX2__) && defined(__FMA__)
namespace {
constexpr int64_t kBytes = 34;     // a Q8_0 block
constexpr int64_t kAhead = 4096;   // W prefetched this many bytes ahead (gguf_gemm.cpp's kAhead: decode streams W)

#define RAYTP_Q8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// one block's 8 int32 partial dots, |w| x (x with w's sign)
RAYTP_Q8 inline __m256i block_dot(const uint8_t* blk, const int8_t* qx) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
// R rows of x against one feature's blocks at a time: each block's bytes, |w| and scale are loaded once for the R
// rows, and each row runs exactly the one-row sequence (its own four accumulators, its 16 scales as one product of
// the gathered d and its grid steps, the same FMA order and final sum), so a row's bits do not depend on R.
template <int R>
RAYTP_Q8 void q8_0_tile(const int8_t* qx, const float* dx, int64_t k_len, const uint8_t* w, int64_t row_bytes,
                        int64_t n0, int64_t n1, float* out, int64_t n_out) {
  const int64_t nb = k_len / 32;
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(kBytes));
  alignas(64) float scale[R][16];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) {
      const uint8_t* base = wr + b * kBytes;
      const __m512i bits = _mm512_i32gather_epi32(offsets, base, 1);  // d in each dword's low half
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm512_store_ps(scale[r], _mm512_mul_ps(d, _mm512_loadu_ps(dx + r * nb + b)));
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const uint8_t* blk = base + j * kBytes;
        if (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead), _MM_HINT_T0);
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        const __m256i wabs = _mm256_abs_epi8(wv);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * k_len + (b + j) * 32));
          const __m256 p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(xv, wv)));
          acc[r][j % 4] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(scale[r] + j), acc[r][j % 4]);
        }
      }
    }
    for (; b < nb; ++b) {  // the last nb % 16 blocks
      const uint8_t* blk = wr + b * kBytes;
      uint16_t bits;
      std::memcpy(&bits, blk, 2);
      const float dw = _cvtsh_ss(bits);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_cvtepi32_ps(block_dot(blk, qx + r * k_len + b * 32));
        acc[r][b % 4] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * dx[r * nb + b]), acc[r][b % 4]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      out[r * n_out + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
  }
}
}  // namespace

RAYTP_Q8 void q8_0_rows(const int8_t* qx, const float* dx, int64_t rows, int64_t k_len, const uint8_t* w,
                        int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t n_out) {
  const int64_t nb = k_len / 32;
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) q8_0_tile<4>(qx + m * k_len, dx + m * nb, k_len, w, row_bytes, n0, n1, out + m * n_out, n_out);
  if (rows - m == 3) q8_0_tile<3>(qx + m * k_len, dx + m * nb, k_len, w, row_bytes, n0, n1, out + m * n_out, n_out);
  if (rows - m == 2) q8_0_tile<2>(qx + m * k_len, dx + m * nb, k_len, w, row_bytes, n0, n1, out + m * n_out, n_out);
  if (rows - m == 1) q8_0_tile<1>(qx + m * k_len, dx + m * nb, k_len, w, row_bytes, n0, n1, out + m * n_out, n_out);
}
#else
void q8_0_rows(const int8_t*, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
               int64_t) {
  TORCH_CHECK(false, "q8_0_rows: built without AVX2 (gguf_gemm.cpp calls it only with AVX-512 VNNI)");
}
#endif

}  // namespace raytp
