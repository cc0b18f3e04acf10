// y = x W^T with W in GGML's K-quant super-blocks (Q4_K, Q6_K), the types Q4_K_M files mix: the CPU path of
// a GGUF linear layer of those types (model_exec/layers/quantization/gguf.py through gguf_gemm.cpp).
//
// Layouts (ggml-common.h, the `gguf` package's numpy dequantize is the reference), a super-block of 256:
//   Q4_K (144 B): fp16 d, fp16 dmin, 12 B of 6-bit scales sc[8] and mins m[8], 128 B of nibbles;
//     sub-block j (32 weights) is w = d sc[j] q - dmin m[j]; bytes 32c..32c+31 hold sub-block 2c in their
//     low nibbles and sub-block 2c + 1 in their high nibbles.
//   Q6_K (210 B): ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16], fp16 d; w = d scales[i / 16]
//     (q - 32) with q in 0..63; half h (128 weights) takes ql[64h..64h+63] (low nibbles: its weights 0..63,
//     high nibbles: 64..127) and qh[32h..32h+31] (bits 2s..2s+1: its weights 32s..32s+31).
//
// The arithmetic is gguf_gemm.cpp's (the decision and its measurement are there): x arrives quantized per
// 32-block (dx, int8 qx) and each 32-weight run of a super-block, which lines up with one x block, is an
// integer dot product scaled once. Q4_K: d sc[j] dx sum(q qx) - dmin m[j] sum(x), the min term on the float
// sum of x (as Q4_1's), so its only error beyond the fp32 reference's rounding is x's int8 rounding. Q6_K:
// a 32-run covers two 16-weight sub-blocks, whose int32 sums land in the lower and upper 4 lanes of the
// AVX2 dot: one scale vector of two halves takes both. Its weights go in signed (q - 32) with x carrying
// their sign, as Q8_0's do.
//
// Work split as gguf_gemm.cpp's: threads take ranges of output features, a chunk of kChunk rows of W is run
// against tiles of kRows rows of x.
#include "gguf_kquants.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace raytp {
namespace {

constexpr int64_t kRows = 4;
constexpr int64_t kChunk = 16;
constexpr int64_t kSubs = kSuper / 32;  // x blocks per super-block

inline float half_bits(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4)
inline void scale_min_k4(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 int32 sums of w . qx over 32 weights; unsigned w (nibbles 0..15: at most 2 * 15 * 127 per int16)
inline __m256i dot_u(__m256i w, const int8_t* qx) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
}

// the same for signed w (|w| <= 32), given |w|
inline __m256i dot_s(__m256i w, __m256i w_abs, const int8_t* qx) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
}

template <int R>
void tile_q4k(const int8_t* qx, const float* dx, const float* sx, int64_t m0, int64_t k_len, const uint8_t* w,
              int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t n_out) {
  const int64_t nb = k_len / 32, ns = k_len / kSuper;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R], accm[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; ++s) {
      const uint8_t* blk = w + n * row_bytes + s * 144;
      const float d = half_bits(blk), dmin = half_bits(blk + 2);
      alignas(32) float dsc[kSubs], dm[kSubs];
      for (int j = 0; j < kSubs; ++j) {
        uint8_t sc, m;
        scale_min_k4(blk + 4, j, &sc, &m);
        dsc[j] = d * sc;
        dm[j] = dmin * m;
      }
      const __m256 dm8 = _mm256_load_ps(dm);
      for (int c = 0; c < 4; ++c) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
        const __m256i lo = _mm256_and_si256(packed, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
        const int64_t b = s * kSubs + 2 * c;
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int64_t row = m0 + r;
          const int8_t* xq = qx + row * k_len + b * 32;
          const __m256 p0 = _mm256_cvtepi32_ps(dot_u(lo, xq));
          const __m256 p1 = _mm256_cvtepi32_ps(dot_u(hi, xq + 32));
          acc[r] = _mm256_fmadd_ps(p0, _mm256_set1_ps(dsc[2 * c] * dx[row * nb + b]), acc[r]);
          acc[r] = _mm256_fmadd_ps(p1, _mm256_set1_ps(dsc[2 * c + 1] * dx[row * nb + b + 1]), acc[r]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) accm[r] = _mm256_fmadd_ps(dm8, _mm256_loadu_ps(sx + (m0 + r) * nb + s * kSubs), accm[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[(m0 + r) * n_out + n] = hsum8(acc[r]) - hsum8(accm[r]);
  }
}

template <int R>
void tile_q6k(const int8_t* qx, const float* dx, const float*, int64_t m0, int64_t k_len, const uint8_t* w,
              int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t n_out) {
  const int64_t nb = k_len / 32, ns = k_len / kSuper;
  const __m256i mask4 = _mm256_set1_epi8(0x0f), mask2 = _mm256_set1_epi8(0x03), m32 = _mm256_set1_epi8(32);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < ns; ++s) {
      const uint8_t* blk = w + n * row_bytes + s * 210;
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = half_bits(blk + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        for (int q = 0; q < 4; ++q) {
          const __m256i ql = q & 1 ? ql1 : ql0;
          const __m256i lo4 = _mm256_and_si256(q < 2 ? ql : _mm256_srli_epi16(ql, 4), mask4);
          // 2 high bits moved to bits 4-5: masked to 2 bits per byte first, so the 16-bit shift stays in its byte
          const __m256i hi2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * q), mask2), 4);
          const __m256i wq = _mm256_sub_epi8(_mm256_or_si256(lo4, hi2), m32);
          const __m256i wa = _mm256_abs_epi8(wq);
          const int sub = 2 * (4 * h + q);  // its two 16-weight sub-blocks: lanes 0-3 and 4-7 of the dot
          const __m256 sc2 = _mm256_set_m128(_mm_set1_ps(d * scales[sub + 1]), _mm_set1_ps(d * scales[sub]));
          const int64_t b = s * kSubs + 4 * h + q;
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const int64_t row = m0 + r;
            const __m256 p = _mm256_cvtepi32_ps(dot_s(wq, wa, qx + row * k_len + b * 32));
            acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(sc2, _mm256_set1_ps(dx[row * nb + b])), acc[r]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[(m0 + r) * n_out + n] = hsum8(acc[r]);
  }
}
#else
// The same sums in plain C++ (builds without AVX2): per 32-run, its integers, two 16-weight scales and the
// min that multiplies the float sum of x.
inline void run32(int64_t qtype, const uint8_t* blk, int j, int32_t* q, float* sc, float* mn) {
  if (qtype == kQ4_K) {
    uint8_t s, m;
    scale_min_k4(blk + 4, j, &s, &m);
    sc[0] = sc[1] = half_bits(blk) * s;
    *mn = half_bits(blk + 2) * m;
    for (int i = 0; i < 32; ++i) q[i] = (blk[16 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0f;
    return;
  }
  const int h = j / 4, part = j % 4;
  const float d = half_bits(blk + 208);
  const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
  sc[0] = d * scales[2 * j];
  sc[1] = d * scales[2 * j + 1];
  *mn = 0.f;
  for (int i = 0; i < 32; ++i) {
    const int lo = (blk[64 * h + 32 * (part & 1) + i] >> (4 * (part / 2))) & 0x0f;
    const int hi = (blk[128 + 32 * h + i] >> (2 * part)) & 0x03;
    q[i] = (lo | (hi << 4)) - 32;
  }
}

template <int R>
void tile_generic(int64_t qtype, const int8_t* qx, const float* dx, const float* sx, int64_t m0, int64_t k_len,
                  const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t n_out) {
  const int64_t nb = k_len / 32, bb = kquant_block_bytes(qtype);
  int32_t q[32];
  float sc[2], mn;
  for (int64_t n = n0; n < n1; ++n) {
    float total[R] = {};
    for (int64_t b = 0; b < nb; ++b) {
      run32(qtype, w + n * row_bytes + b / kSubs * bb, static_cast<int>(b % kSubs), q, sc, &mn);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = qx + (m0 + r) * k_len + b * 32;
        int32_t d0 = 0, d1 = 0;
        for (int i = 0; i < 16; ++i) d0 += q[i] * xq[i];
        for (int i = 16; i < 32; ++i) d1 += q[i] * xq[i];
        total[r] += dx[(m0 + r) * nb + b] * (sc[0] * d0 + sc[1] * d1) - mn * sx[(m0 + r) * nb + b];
      }
    }
    for (int r = 0; r < R; ++r) out[(m0 + r) * n_out + n] = total[r];
  }
}
#endif

template <int R>
void tile(int64_t qtype, const int8_t* qx, const float* dx, const float* sx, int64_t m0, int64_t k_len,
          const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t n_out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (qtype == kQ4_K) tile_q4k<R>(qx, dx, sx, m0, k_len, w, row_bytes, n0, n1, out, n_out);
  else tile_q6k<R>(qx, dx, sx, m0, k_len, w, row_bytes, n0, n1, out, n_out);
#else
  tile_generic<R>(qtype, qx, dx, sx, m0, k_len, w, row_bytes, n0, n1, out, n_out);
#endif
}

}  // namespace

int64_t kquant_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_K: return 144;
    case kQ6_K: return 210;
    default: return 0;
  }
}

void kquant_linear(int64_t qtype, const int8_t* qx, const float* dx, const float* sx, int64_t rows, int64_t k_len,
                   const uint8_t* w, int64_t n_out, float* out) {
  TORCH_CHECK(kquant_block_bytes(qtype) > 0, "kquant_linear: GGML type ", qtype, " is not Q4_K or Q6_K");
  TORCH_CHECK(k_len % kSuper == 0, "gguf_linear: K = ", k_len, " is not a multiple of 256 (a K-quant super-block)");
  const int64_t row_bytes = k_len / kSuper * kquant_block_bytes(qtype);
  at::parallel_for(0, n_out, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kChunk) {
      const int64_t n1 = std::min(end, n0 + kChunk);
      int64_t m = 0;
      for (; m + kRows <= rows; m += kRows) tile<kRows>(qtype, qx, dx, sx, m, k_len, w, row_bytes, n0, n1, out, n_out);
      for (; m < rows; ++m) tile<1>(qtype, qx, dx, sx, m, k_len, w, row_bytes, n0, n1, out, n_out);
    }
  });
}

}  // namespace raytp
