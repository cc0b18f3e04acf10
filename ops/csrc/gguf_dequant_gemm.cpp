// The GGUF linear for many rows of x (a prefill chunk): W's blocks are dequantized to fp32, a chunk of 32 output
// features at a time, laid out as the fp32 panels of panel_gemm.cpp ([K, 16] per 16 features), and every row
// tile of x runs against that chunk on the FMA units (12 rows x 2 panels: 24 accumulators, one broadcast of x
// and two panel loads per k).
//
// Why (measured, docs/benchmarks.md): gguf_gemm.cpp's integer tiles cost per row and per pair of blocks two
// vpdpbusd (16-bit x), a fold, a convert, a scale product and two FMAs: ~1.6x the instructions of the fp32 panel
// tile per weight, so a 128-token prefill of the Q4_1 model ran at 0.46x the fp32 model's rate. Dequantizing a
// chunk of W costs a fixed ~1 cycle per weight (vector unpack, then a gather into the panel layout), ~8 rows'
// worth of FMAs, so from kDequantRows rows on the chunk's FMA tiles win, and at 128 rows the product runs
// near the fp32 panels' rate while reading W's blocks, not 4 bytes per weight, from memory.
//
// Arithmetic: the weights are exactly the dequantized reference's (GGUFTensor.dequantize: d * q + m as a
// product then a sum, never fused), and each output is one fp32 accumulator FMA'd over k in order, so the rows
// on this road match the float product with the dequantized weights to float32 rounding (better than the
// integer tiles, which round x). The price: a row's result depends on which road its call took (the integer
// tiles below kDequantRows rows, this one from there), so GGUF products are not batch-invariant across that
// threshold, as the fp32 panels are (they are not the fp32 panels' bits either way).
//
// Work split: threads take ranges of 32-feature chunks; each dequantizes its chunk once per block of
// kRowBlock rows of x (x's block stays in L2 while the chunk's 2 x K x 16 floats sit in L1/L2).
#include "gguf_dequant_gemm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gguf_kquants.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#endif

// AVX-512F for the tiles, F16C for the scales (the file is built for AVX2: these functions alone for more)
#define RAYTP_DQ __attribute__((target("avx512f,f16c")))

namespace raytp {
namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids (the K-quants' are in gguf_kquants.h)
constexpr int64_t kPanel = 16;                      // features per panel: one AVX-512 vector
constexpr int64_t kPanels = 2;                      // panels per chunk: the 12 x 2 tile's width
constexpr int64_t kRowBlock = 256;                  // rows of x per pass over a chunk: 256 x 1536 x 4 B = 1.5 MB

#if defined(__AVX2__) && defined(__FMA__)
RAYTP_DQ inline __m512 half16(const uint8_t* p) {  // one fp16 broadcast to 16 lanes, exactly converted
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm512_set1_ps(_cvtsh_ss(bits));
}

RAYTP_DQ inline __m512 bytes_u(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
RAYTP_DQ inline __m512 bytes_s(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
RAYTP_DQ inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// One row of W (row_bytes of blocks) as K floats, the values of gguf_tensor.py's dequantization.
RAYTP_DQ void dequant_row(int64_t qtype, const uint8_t* row, int64_t k_len, float* dst) {
  const __m128i nib = _mm_set1_epi8(0x0f);
  if (qtype == kQ8_0 || qtype == kQ4_0 || qtype == kQ4_1) {
    const int64_t bb = qtype == kQ8_0 ? 34 : qtype == kQ4_0 ? 18 : 20;
    for (int64_t b = 0; b < k_len / 32; ++b, dst += 32) {
      const uint8_t* blk = row + b * bb;
      const __m512 d = half16(blk);
      __m512 lo, hi;
      if (qtype == kQ8_0) {
        lo = bytes_s(load16(blk + 2));
        hi = bytes_s(load16(blk + 18));
      } else {
        const __m128i packed = load16(blk + (qtype == kQ4_1 ? 4 : 2));
        lo = bytes_u(_mm_and_si128(packed, nib));
        hi = bytes_u(_mm_and_si128(_mm_srli_epi16(packed, 4), nib));
      }
      if (qtype == kQ4_0) {
        lo = _mm512_sub_ps(lo, _mm512_set1_ps(8.f));
        hi = _mm512_sub_ps(hi, _mm512_set1_ps(8.f));
      }
      lo = _mm512_mul_ps(d, lo);
      hi = _mm512_mul_ps(d, hi);
      if (qtype == kQ4_1) {
        const __m512 m = half16(blk + 2);
        lo = _mm512_add_ps(lo, m);
        hi = _mm512_add_ps(hi, m);
      }
      _mm512_storeu_ps(dst, lo);
      _mm512_storeu_ps(dst + 16, hi);
    }
    return;
  }
  if (qtype == kQ4_K) {  // per 64 weights: sub-blocks 2c (low nibbles) and 2c + 1 (high) of bytes 32c..32c+31
    for (int64_t s = 0; s < k_len / kSuper; ++s) {
      const uint8_t* sb = row + s * 144;
      const float d = _mm_cvtss_f32(_mm512_castps512_ps128(half16(sb))), dmin = _mm_cvtss_f32(_mm512_castps512_ps128(half16(sb + 2)));
      const uint8_t* sc = sb + 4;
      for (int j = 0; j < 8; ++j, dst += 32) {
        int sv, mv;  // ggml's get_scale_min_k4
        if (j < 4) {
          sv = sc[j] & 63;
          mv = sc[j + 4] & 63;
        } else {
          sv = (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4);
          mv = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        const __m512 d1 = _mm512_set1_ps(d * static_cast<float>(sv)), m1 = _mm512_set1_ps(dmin * static_cast<float>(mv));
        const uint8_t* q = sb + 16 + 32 * (j / 2);
        for (int h = 0; h < 2; ++h) {
          __m128i v = load16(q + 16 * h);
          v = j % 2 ? _mm_and_si128(_mm_srli_epi16(v, 4), nib) : _mm_and_si128(v, nib);
          _mm512_storeu_ps(dst + 16 * h, _mm512_sub_ps(_mm512_mul_ps(d1, bytes_u(v)), m1));
        }
      }
    }
    return;
  }
  TORCH_CHECK(qtype == kQ6_K, "gguf_dequant_linear: GGML type ", qtype, " has no kernel");
  for (int64_t s = 0; s < k_len / kSuper; ++s) {  // ggml's dequantize_row_q6_K, 16 weights at a time
    const uint8_t* sb = row + s * 210;
    const uint8_t* scales = sb + 192;
    const float d = _mm_cvtss_f32(_mm512_castps512_ps128(half16(sb + 208)));
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = sb + 64 * h;
      const uint8_t* qh = sb + 128 + 32 * h;
      for (int q = 0; q < 4; ++q) {      // weights 32q..32q+31 of the half
        for (int g = 0; g < 2; ++g, dst += 16) {  // l = 16g..16g+15
          __m128i lo = load16(ql + 32 * (q & 1) + 16 * g);
          lo = q >= 2 ? _mm_and_si128(_mm_srli_epi16(lo, 4), nib) : _mm_and_si128(lo, nib);
          const __m128i hi = _mm_and_si128(_mm_srli_epi16(load16(qh + 16 * g), 2 * q), _mm_set1_epi8(3));
          const __m128i v = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
          const float scale = d * static_cast<float>(static_cast<int8_t>(scales[8 * h + 2 * q + g]));
          _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_set1_ps(scale), bytes_s(v)));
        }
      }
    }
  }
}

// rows [kPanels * 16][K] (row-major, zero past the last feature) -> panels [kPanels][K][16]
RAYTP_DQ void to_panels(const float* rows, int64_t k_len, float* panels) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(k_len)));
  for (int64_t p = 0; p < kPanels; ++p)
    for (int64_t k = 0; k < k_len; ++k)
      _mm512_storeu_ps(panels + (p * k_len + k) * kPanel, _mm512_i32gather_ps(idx, rows + p * kPanel * k_len + k, 4));
}

// MB rows of x against NP panels: out[m, 16p + j] for the n_left features still to write.
template <int MB, int NP>
RAYTP_DQ inline void tile(const float* x, int64_t ldx, const float* w, int64_t k_len, float* out, int64_t ldo,
                              int64_t n_left) {
  __m512 acc[MB][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 wv[NP];
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(w + (p * k_len + k) * kPanel);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xb, wv[p], acc[m][p]);
    }
  }
#pragma GCC unroll 2
  for (int p = 0; p < NP; ++p) {
    const int64_t cols = std::min<int64_t>(kPanel, n_left - p * kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(out + m * ldo + p * kPanel, mask, acc[m][p]);
  }
}

template <int MB>
RAYTP_DQ void tile_np(const float* x, int64_t ldx, const float* w, int64_t k_len, float* out, int64_t ldo,
                          int64_t n_left) {
  if (n_left > kPanel) tile<MB, 2>(x, ldx, w, k_len, out, ldo, n_left);
  else tile<MB, 1>(x, ldx, w, k_len, out, ldo, n_left);
}

// every row of x [rows, K] against one chunk's panels
RAYTP_DQ void rows_on_chunk(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t k_len, float* out,
                                int64_t ldo, int64_t n_left) {
  int64_t m = 0;
  for (; m + 12 <= rows; m += 12) tile_np<12>(x + m * ldx, ldx, w, k_len, out + m * ldo, ldo, n_left);
  const float* xt = x + m * ldx;
  float* ot = out + m * ldo;
  switch (rows - m) {
    case 1: tile_np<1>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 2: tile_np<2>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 3: tile_np<3>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 4: tile_np<4>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 5: tile_np<5>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 6: tile_np<6>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 7: tile_np<7>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 8: tile_np<8>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 9: tile_np<9>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 10: tile_np<10>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    case 11: tile_np<11>(xt, ldx, w, k_len, ot, ldo, n_left); break;
    default: break;
  }
}

RAYTP_DQ void run(int64_t qtype, const float* x, int64_t ldx, int64_t rows, int64_t k_len, const uint8_t* w,
                      int64_t row_bytes, int64_t n_out, float* out) {
  constexpr int64_t kWidth = kPanels * kPanel;
  const int64_t chunks = (n_out + kWidth - 1) / kWidth;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> dense(kWidth * k_len), panels(kWidth * k_len);
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
      const int64_t mb = std::min(kRowBlock, rows - m0);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n0 = c * kWidth, n1 = std::min(n_out, n0 + kWidth);
        for (int64_t n = n0; n < n1; ++n) dequant_row(qtype, w + n * row_bytes, k_len, dense.data() + (n - n0) * k_len);
        std::fill(dense.begin() + (n1 - n0) * k_len, dense.end(), 0.f);
        to_panels(dense.data(), k_len, panels.data());
        rows_on_chunk(x + m0 * ldx, ldx, mb, panels.data(), k_len, out + m0 * n_out + n0, n_out, n1 - n0);
      }
    }
  });
}
#endif

}  // namespace

bool dequant_road(int64_t rows, int64_t road) {
  TORCH_CHECK(road == kRoadByRows || road == kRoadInteger || road == kRoadDequant, "gguf_linear: unknown road ", road);
#if defined(__AVX2__) && defined(__FMA__)
  if (road != kRoadByRows) return road == kRoadDequant && use_avx512();
  const char* env = std::getenv("RAYTP_GGUF_DEQUANT_ROWS");
  const int64_t from = env != nullptr && std::atoll(env) > 0 ? std::atoll(env) : kDequantRows;
  return rows >= from && use_avx512();
#else
  (void)rows;
  return false;
#endif
}

void gguf_dequant_linear(int64_t qtype, const float* x, int64_t ldx, int64_t rows, int64_t k_len, const uint8_t* w,
                         int64_t row_bytes, int64_t n_out, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(use_avx512(), "gguf_dequant_linear: needs AVX-512F");
  run(qtype, x, ldx, rows, k_len, w, row_bytes, n_out, out);
#else
  TORCH_CHECK(false, "gguf_dequant_linear: built without AVX2");
#endif
}

}  // namespace raytp
