// y = x W^T with W kept in its GGUF block layout (Q8_0, Q4_0, Q4_1): the CPU path of a linear layer whose
// weights came quantized from a GGUF file (model_exec/layers/quantization/gguf.py).
//
// Layout: W [N, K] is GGUF's own, row by row: each row is K / 32 blocks of 32 weights,
//   Q8_0: fp16 d, 32 x int8 q                 w = d * q              (34 bytes)
//   Q4_0: fp16 d, 16 bytes of nibbles         w = d * (q - 8)        (18 bytes)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles w = d * q + m          (20 bytes)
// with weight j < 16 in the low nibble of byte j and weight j + 16 in its high nibble.
//
// The decision (measured, docs/benchmarks.md): x is quantized per 32-block to int8 with a float scale, as
// llama.cpp does (its Q8_0/Q8_1 activations), and the dot products run on integers: 32 weights cost one
// 16-byte load, two nibble masks, one maddubs + one madd, one int->float convert and one FMA per row of x.
// Dequantizing W to floats in registers costs 4 converts and 4 FMAs per 32 weights instead, and a decode
// step on this machine is bound by those instructions, not by the 5-6x fewer bytes read. Per block:
//   sum_j w_j x_j ~= d * dx * sum_j q_j qx_j  (+ m * sum_j x_j for Q4_1, - 8 d dx sum_j qx_j for Q4_0)
// where dx = max|x_block| / 127 and qx = round(x / dx); the sum of x for Q4_1's offset uses the float x,
// so the only error beyond the fp32 reference's rounding is x's rounding: int8's (relative ~0.2% per element)
// for Q8_0 and the K-quants, 16 bits' for Q4_0 / Q4_1, whose qx is two bytes (`kTwoByteX` below: it took the
// Q4_1 model's perplexity from +0.66% to +0.21% of the dequantized weights' for ~10% more time per
// weight); tests/ops/test_gguf_gemm.py bounds both against the dequantized product.
//
// Two other roads (measured, docs/benchmarks.md): from kDequantRows (16) rows of x, with AVX-512F, the call goes to
// gguf_dequant_gemm.cpp (W dequantized per 32-feature chunk into fp32 panels, FMA tiles: the integer tiles below
// cost ~1.6x the fp32 panels' instructions per weight and row, so a 128-token prefill ran at ~0.4x the fp32
// model's rate); and with AVX-512 VNNI a Q8_0 matrix's rows run gguf_q8_rows.cpp's tiles. Both keep this function's
// signature; the fused decoder layer (decode_layer.cpp) calls it as an op. A third: the integer rows of a Q4_0 /
// Q4_1 layer given its copy repacked at load (`packed`, gguf_q4x16.cpp: 16 features per vpdpbusd, ~2.3x fewer
// instructions per layer) run on that copy, with these tiles' bits. The caller may name the road (`road`,
// gguf_dequant_gemm.h): the engine picks it by each row's kind, and on either road a row's bits do not depend
// on the other rows of the call (tests/ops/test_gguf_row_roads.py).
//
// Work split: threads take ranges of output features (each reads only its share of W, in file order); inside,
// a chunk of kChunk output rows (a few KB of W, kept in L1/L2) is run against every tile of kRows rows of x.
//
// The decode step (one row of x; issue 39's Q4_1 target, measured in docs/benchmarks.md): Q4_0 / Q4_1 run
// `q4_row_features`, four output features per pass sharing x's loads (-17% per layer in L2, -5% streaming the
// 30 layers, thread CPU time on one core), bit-identical to the one-feature tile; x is quantized by an AVX-512
// loop into per-thread buffers kept between calls (a small matrix's call 5.4 -> 2.8 us). Tried and dropped: the
// same four-feature pass for Q8_0's row tile (the LM head: 1.62 -> 1.70 ms, slower), W prefetch distances
// other than 4 KB (1 KB +31%, 2 KB +13%, 8-16 KB equal).
//
// x [M, K] float32 with a contiguous last dim, K a multiple of 32; w [N, K / 32 * block bytes] uint8 contiguous.
// Q4_K and Q6_K (256-weight super-blocks, K a multiple of 256) take the same quantized x into their own
// kernels (gguf_kquants.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "gguf_dequant_gemm.h"
#include "gguf_kquants.h"
#include "gguf_q4x16.h"
#include "gguf_q8x16.h"
#include "gguf_q8_rows.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace {

constexpr int64_t kBlock = 32;
// GGML's type ids (ggml.h, the `gguf` package's GGMLQuantizationType)
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kRows = 4;    // rows of x per tile: each unpacked weight block is reused this many times
constexpr int64_t kChunk = 16;  // output rows per chunk: 16 x 960 B = 15 KB of W at SmolLM2's widest row
// Software prefetch of W this many bytes ahead of the pair a tile reads (into L1): a decode step streams W from
// DRAM once, and the hardware prefetcher alone left the tiles waiting on it. Measured on one core of this
// project's shared 2-core VM (thread CPU time, interleaved, the 49152 x 576 LM head): Q8_0 4.1 -> 1.95 ms,
// Q4_1 2.2 -> 1.8 ms; 1 KB ahead gained half of that, 2 KB most, 4 KB all.
constexpr int64_t kAhead = 4096;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    default: TORCH_CHECK(false, "gguf_linear: GGML type ", qtype, " has no kernel (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K do)");
  }
  return 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_0 and Q4_1 take x on a 16-bit grid: X = round(x / (dx / 256)) (|X| <= 32512) split exactly into two int8
// bytes, X = 256 hi + lo (hi in [-127, 127], lo in [-128, 127]), and each block's integer dot is
// 256 (w . hi) + (w . lo): one more vpdpbusd and a shift per pair of blocks. On 8 bits alone a Q4_1 SmolLM2-135M
// scored +0.66% perplexity above its dequantized weights, from x's rounding only (the LM head, Q8_0, kept
// its share of that near zero); on 16 bits the blocks are the dequantized product to float rounding. Q8_0
// (a vpdpbusd needs |w| and x with w's sign, which -128 cannot carry) and the K-quants keep 8 bits.
template <int64_t Q>
constexpr bool kTwoByteX = Q == kQ4_0 || Q == kQ4_1;

// x's rows quantized per block: q int8 [M, K] (x's byte, or X's high byte), r int8 [M, K] (X's low byte, two-byte
// types only), d [M, nb] (the grid step: dx, or dx / 256), s [M, nb] (sum of the float x: Q4_1's offset term),
// c8 [M, nb] (8 * d * sum of the grid values: Q4_0's offset term).
struct QuantX {
  std::vector<int8_t> q, r;
  std::vector<float> d, s, c8;
  std::vector<int32_t> qs;  // [M, nb] the sum of the grid values per block (the Q8_0 packed kernel's offset)
  // the AVX-512 VNNI pair tiles' copies (`interleave_pairs`): filled only when those tiles run
  std::vector<int8_t> qv, rv;
  std::vector<float> dx8, e8;
  bool two = false;   // two bytes per x (r holds the low bytes)
  bool vnni = false;  // qv / rv / dx8 / e8 are filled and the VNNI tiles run
};

// r == nullptr: one byte per x; else two (q the high, r the low byte of X)
void quantize_row(const float* x, int64_t k_len, int8_t* q, int8_t* r, float* d, float* s, float* c8, int32_t* qs) {
  for (int64_t b = 0; b < k_len / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < kBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      sum += xb[j];
    }
    const float dx = amax / 127.f;
    const float step = r == nullptr ? dx : dx / 256.f;  // a power of two apart: exact
    const float inv = dx > 0.f ? 1.f / step : 0.f;
    int32_t isum = 0;
    for (int j = 0; j < kBlock; ++j) {
      // nearbyint: round half to even under the default rounding mode, as _mm256_cvtps_epi32 and torch.round
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
      if (r == nullptr) {
        q[b * kBlock + j] = static_cast<int8_t>(v);
      } else {
        const int32_t hi = (v + 128) >> 8;  // floor((v + 128) / 256): lo = v - 256 hi lands in [-128, 127]
        q[b * kBlock + j] = static_cast<int8_t>(hi);
        r[b * kBlock + j] = static_cast<int8_t>(v - 256 * hi);
      }
      isum += v;
    }
    d[b] = step;
    s[b] = sum;
    c8[b] = 8.f * step * static_cast<float>(isum);
    qs[b] = isum;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 32 weights of a block as bytes in x's order: Q4 nibbles unpacked (unsigned 0..15), Q8 as stored (signed).
template <int64_t Q>
inline __m256i unpack(const uint8_t* blk) {
  if constexpr (Q == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == kQ4_1 ? 4 : 2)));
    const __m128i lo_mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, lo_mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), lo_mask);
    return _mm256_set_m128i(hi, lo);
  }
}

// 8 int32 partial sums of w . qx over one block
template <int64_t Q>
inline __m256i dot_block(__m256i w, const int8_t* qx) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  __m256i p16;
  if constexpr (Q == kQ8_0) {  // maddubs wants unsigned x signed: |w| times x with w's sign
    p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
  } else {
    p16 = _mm256_maddubs_epi16(w, xv);  // nibbles 0..15 x int8: at most 2 * 15 * 128 per int16, no saturation
  }
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

template <int64_t Q, int R>
void tile(const QuantX& qx, int64_t m0, int64_t k_len, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
          float* out, int64_t n_out) {
  const int64_t nb = k_len / kBlock;
  const int64_t bb = block_bytes(Q);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[R];
    float extra[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      extra[r] = 0.f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wr + b * bb;
      const float dw = half_at(blk);
      const __m256i wv = unpack<Q>(blk);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t row = m0 + r;
        __m256i dot = dot_block<Q>(wv, qx.q.data() + row * k_len + b * kBlock);
        if constexpr (kTwoByteX<Q>)
          dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), dot_block<Q>(wv, qx.r.data() + row * k_len + b * kBlock));
        const __m256 p = _mm256_cvtepi32_ps(dot);
        acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * qx.d[row * nb + b]), acc[r]);
        if constexpr (Q == kQ4_1) extra[r] += half_at(blk + 2) * qx.s[row * nb + b];
        if constexpr (Q == kQ4_0) extra[r] -= dw * qx.c8[row * nb + b];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[(m0 + r) * n_out + n] = raytp::hsum8(acc[r]) + extra[r];
  }
}

// ---- AVX-512 VNNI: two blocks per instruction -------------------------------------------------------------
// One vpdpbusd multiplies 64 weight bytes with 64 activation bytes and sums them 4 by 4: two blocks at once.
// Both operands are laid out per pair of blocks (b0, b1) as [b0 0..15 | b1 0..15 | b0 16..31 | b1 16..31]:
// that is how two Q4 blocks unpack with one mask/shift over both (low nibbles, then high), so the 16 int32
// sums fold into 8 (lanes 0-3: b0, 4-7: b1) with one add, and each lane takes its block's scale. (Q8_0 runs
// gguf_q8_rows.cpp's tiles instead: its pair is more than one load.)
#define RAYTP_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

bool use_vnni() {
  static const bool yes =
      raytp::use_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return yes;
}

// qx rows re-laid per block pair (the odd last block stays as it is); dx8 / e8: per pair, 4 lanes of each block's
// scale / offset term (Q4_1: sum of x, Q4_0: 8 dx sum of qx) divided by 4, as the folded lanes want them.
void interleave_bytes(const int8_t* src, int8_t* dst, int64_t k_len) {
  const int64_t nb = k_len / kBlock, np = nb / 2;
  for (int64_t p = 0; p < np; ++p) {
    const int8_t* b0 = src + 2 * p * kBlock;
    std::memcpy(dst + p * 64, b0, 16);
    std::memcpy(dst + p * 64 + 16, b0 + kBlock, 16);
    std::memcpy(dst + p * 64 + 32, b0 + 16, 16);
    std::memcpy(dst + p * 64 + 48, b0 + kBlock + 16, 16);
  }
  if (nb % 2) std::memcpy(dst + (nb - 1) * kBlock, src + (nb - 1) * kBlock, kBlock);
}

void interleave_pairs(QuantX& qx, int64_t m, int64_t k_len, int64_t qtype) {
  const int64_t nb = k_len / kBlock, np = nb / 2;
  interleave_bytes(qx.q.data() + m * k_len, qx.qv.data() + m * k_len, k_len);
  if (qx.two) interleave_bytes(qx.r.data() + m * k_len, qx.rv.data() + m * k_len, k_len);
  const float* e = qtype == kQ4_1 ? qx.s.data() + m * nb : qx.c8.data() + m * nb;
  for (int64_t p = 0; p < np; ++p) {
    float* d8 = qx.dx8.data() + (m * np + p) * 8;
    float* e8 = qx.e8.data() + (m * np + p) * 8;
    for (int i = 0; i < 4; ++i) {
      d8[i] = qx.d[m * nb + 2 * p];
      d8[4 + i] = qx.d[m * nb + 2 * p + 1];
      e8[i] = e[2 * p] / 4.f;
      e8[4 + i] = e[2 * p + 1] / 4.f;
    }
  }
}

RAYTP_VNNI inline float half_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// quantize_row in AVX-512: the same grid values (x * inv rounded half to even, as nearbyint under the default
// rounding mode), d and c8; only s, the float sum of x, is summed in another order (a float rounding apart).
// A decode step quantizes x ~121 times a token and the scalar loop was most of a small matrix's call.
RAYTP_VNNI void quantize_row_avx512(const float* x, int64_t k_len, int8_t* q, int8_t* r, float* d, float* s, float* c8,
                                    int32_t* qs) {
  for (int64_t b = 0; b < k_len / kBlock; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * kBlock), x1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float dx = amax / 127.f;
    const float step = r == nullptr ? dx : dx / 256.f;
    const __m512 inv = _mm512_set1_ps(dx > 0.f ? 1.f / step : 0.f);
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    if (r == nullptr) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(v0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(v1));
    } else {  // hi = floor((v + 128) / 256), lo = v - 256 hi, as quantize_row splits
      const __m512i c128 = _mm512_set1_epi32(128);
      const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(v0, c128), 8), h1 = _mm512_srai_epi32(_mm512_add_epi32(v1, c128), 8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(h0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(h1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r + b * kBlock),
                       _mm512_cvtepi32_epi8(_mm512_sub_epi32(v0, _mm512_slli_epi32(h0, 8))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r + b * kBlock + 16),
                       _mm512_cvtepi32_epi8(_mm512_sub_epi32(v1, _mm512_slli_epi32(h1, 8))));
    }
    d[b] = step;
    s[b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    const int32_t isum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
    c8[b] = 8.f * step * static_cast<float>(isum);
    qs[b] = isum;
  }
}

// Q4_0 / Q4_1 pairs from one load: the pair's 36 / 40 bytes come in one masked 64-byte load (fault-free past the
// end of w) and two word permutes lay them out, one into the nibble layout above, one into the scales: words
// [d0 x4, d1 x4, m0 x4, m1 x4], converted by one vcvtph2ps. Every field sits at an even byte offset (nibbles
// at 2 or 4, the second block at 18 or 20), so word indices reach them all. The same values as unpacking each
// block and converting each scale alone (half -> float is exact), in about half the instructions: a single
// stream's decode is bound by this loop's issue rate more than by the bytes it reads.
template <int64_t Q>
struct Q4PairIndex {
  static constexpr int kBytes = Q == kQ4_1 ? 20 : 18, kNib = Q == kQ4_1 ? 4 : 2;
  static constexpr int n0 = kNib / 2, n1 = (kBytes + kNib) / 2, d1 = kBytes / 2;
};

template <int64_t Q>
RAYTP_VNNI inline __m512i nibble_words() {
  using I = Q4PairIndex<Q>;
  return _mm512_set_epi16(I::n1 + 7, I::n1 + 6, I::n1 + 5, I::n1 + 4, I::n1 + 3, I::n1 + 2, I::n1 + 1, I::n1,
                          I::n0 + 7, I::n0 + 6, I::n0 + 5, I::n0 + 4, I::n0 + 3, I::n0 + 2, I::n0 + 1, I::n0,
                          I::n1 + 7, I::n1 + 6, I::n1 + 5, I::n1 + 4, I::n1 + 3, I::n1 + 2, I::n1 + 1, I::n1,
                          I::n0 + 7, I::n0 + 6, I::n0 + 5, I::n0 + 4, I::n0 + 3, I::n0 + 2, I::n0 + 1, I::n0);
}

template <int64_t Q>
RAYTP_VNNI inline __m512i scale_words() {
  using I = Q4PairIndex<Q>;  // words 16..31 unused
  return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,                      //
                          I::d1 + 1, I::d1 + 1, I::d1 + 1, I::d1 + 1, 1, 1, 1, 1,                // m1 x4, m0 x4
                          I::d1, I::d1, I::d1, I::d1, 0, 0, 0, 0);                              // d1 x4, d0 x4
}

template <int64_t Q>
RAYTP_VNNI inline void load_q4_pair(const uint8_t* b0, const __m512i& nib_idx, const __m512i& scale_idx,
                                    __m512i& wv, __m256& dw8, __m256& m8) {
  const __m512i raw = _mm512_maskz_loadu_epi8((1ULL << (2 * Q4PairIndex<Q>::kBytes)) - 1, b0);
  const __m512i t = _mm512_permutexvar_epi16(nib_idx, raw);
  const __m512i both = _mm512_mask_blend_epi64(0xF0, t, _mm512_srli_epi16(t, 4));  // upper half: high nibbles
  wv = _mm512_and_si512(both, _mm512_set1_epi8(0x0f));
  const __m512 f = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(scale_idx, raw)));
  dw8 = _mm512_castps512_ps256(f);
  m8 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1));
}

template <int64_t Q, int R>
RAYTP_VNNI void tile_vnni(const QuantX& qx, int64_t m0, int64_t k_len, const uint8_t* w, int64_t row_bytes,
                          int64_t n0, int64_t n1, float* out, int64_t n_out) {
  const int64_t nb = k_len / kBlock, np = nb / 2;
  const int64_t bb = block_bytes(Q);
  static_assert(Q == kQ4_0 || Q == kQ4_1, "Q8_0 runs gguf_q8_rows.cpp's tiles");
  const __m512i nib_idx = nibble_words<Q>(), scale_idx = scale_words<Q>();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[R], accm[R];
    float extra[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r] = accm[r] = _mm256_setzero_ps();
      extra[r] = 0.f;
    }
    for (int64_t p = 0; p < np; ++p) {
      const uint8_t* b0 = wr + 2 * p * bb;
      _mm_prefetch(reinterpret_cast<const char*>(b0 + kAhead), _MM_HINT_T0);
      __m256 dw8, m8;
      __m512i wv;
      load_q4_pair<Q>(b0, nib_idx, scale_idx, wv, dw8, m8);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t row = m0 + r;
        const __m512i xv = _mm512_loadu_si512(qx.qv.data() + row * k_len + p * 64);
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        if constexpr (kTwoByteX<Q>)
          s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), wv, _mm512_loadu_si512(qx.rv.data() + row * k_len + p * 64));
        const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        const __m256 scale = _mm256_mul_ps(dw8, _mm256_loadu_ps(qx.dx8.data() + (row * np + p) * 8));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s8), scale, acc[r]);
        if constexpr (Q == kQ4_1) accm[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(qx.e8.data() + (row * np + p) * 8), accm[r]);
        if constexpr (Q == kQ4_0) accm[r] = _mm256_fnmadd_ps(dw8, _mm256_loadu_ps(qx.e8.data() + (row * np + p) * 8), accm[r]);
      }
    }
    if (nb % 2) {  // the odd last block, as the AVX2 tiles take it (it sits unpaired in qv)
      const int64_t b = nb - 1;
      const uint8_t* blk = wr + b * bb;
      const float dw = half_f16c(blk);
      const __m256i wv = unpack<Q>(blk);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t row = m0 + r;
        __m256i dot = dot_block<Q>(wv, qx.qv.data() + row * k_len + b * kBlock);
        if constexpr (kTwoByteX<Q>)
          dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), dot_block<Q>(wv, qx.rv.data() + row * k_len + b * kBlock));
        const __m256 p = _mm256_cvtepi32_ps(dot);
        acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * qx.d[row * nb + b]), acc[r]);
        if constexpr (Q == kQ4_1) extra[r] += half_f16c(blk + 2) * qx.s[row * nb + b];
        if constexpr (Q == kQ4_0) extra[r] -= dw * qx.c8[row * nb + b];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[(m0 + r) * n_out + n] = raytp::hsum8(_mm256_add_ps(acc[r], accm[r])) + extra[r];
  }
}

// One row of x (a decode step) against kFeatures output features at once (Q4_0 / Q4_1): x's four per-pair loads
// (two byte planes, scales, offset terms) are shared by the features, their FMA chains are independent, and the
// four horizontal sums end in one 4x4 transpose. Each feature's lanes take exactly tile_vnni<Q, 1>'s operations
// in its order, and the transpose sums each as hsum8 does, so the outputs are bit-identical to the one-feature
// tile (the features n1 - n0 leaves over run through it).
constexpr int64_t kFeatures = 4;

template <int64_t Q>
RAYTP_VNNI void q4_row_features(const QuantX& qx, int64_t m, int64_t k_len, const uint8_t* w, int64_t row_bytes,
                                int64_t n, float* out) {  // out: the features' 4 outputs
  constexpr int F = kFeatures;
  const int64_t nb = k_len / kBlock, np = nb / 2;
  const int64_t bb = block_bytes(Q);
  const __m512i nib_idx = nibble_words<Q>(), scale_idx = scale_words<Q>();
  const int8_t* xq = qx.qv.data() + m * k_len;
  const int8_t* xr = qx.rv.data() + m * k_len;
  const float* xd = qx.dx8.data() + m * np * 8;
  const float* xe = qx.e8.data() + m * np * 8;
  const uint8_t* wr = w + n * row_bytes;
  __m256 acc[F], accm[F];
#pragma GCC unroll 4
  for (int f = 0; f < F; ++f) acc[f] = accm[f] = _mm256_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    const __m512i xv = _mm512_loadu_si512(xq + p * 64), rv = _mm512_loadu_si512(xr + p * 64);
    const __m256 dx = _mm256_loadu_ps(xd + p * 8), ex = _mm256_loadu_ps(xe + p * 8);
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) {
      const uint8_t* b0 = wr + f * row_bytes + 2 * p * bb;
      _mm_prefetch(reinterpret_cast<const char*>(b0 + kAhead), _MM_HINT_T0);
      __m256 dw8, m8;
      __m512i wv;
      load_q4_pair<Q>(b0, nib_idx, scale_idx, wv, dw8, m8);
      __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
      s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), wv, rv);
      const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
      acc[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s8), _mm256_mul_ps(dw8, dx), acc[f]);
      if constexpr (Q == kQ4_1) accm[f] = _mm256_fmadd_ps(m8, ex, accm[f]);
      if constexpr (Q == kQ4_0) accm[f] = _mm256_fnmadd_ps(dw8, ex, accm[f]);
    }
  }
  alignas(16) float extra[F] = {};
  if (nb % 2) {  // the odd last block (unpaired in qv), as tile_vnni<Q, 1> takes it
    const int64_t b = nb - 1;
    const float dxb = qx.d[m * nb + b];
    for (int f = 0; f < F; ++f) {
      const uint8_t* blk = wr + f * row_bytes + b * bb;
      const float dw = half_f16c(blk);
      const __m256i wv = unpack<Q>(blk);
      const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(dot_block<Q>(wv, xq + b * kBlock), 8),
                                           dot_block<Q>(wv, xr + b * kBlock));
      acc[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dxb), acc[f]);
      if constexpr (Q == kQ4_1) extra[f] = half_f16c(blk + 2) * qx.s[m * nb + b];
      if constexpr (Q == kQ4_0) extra[f] = -(dw * qx.c8[m * nb + b]);
    }
  }
  __m128 v[F];
#pragma GCC unroll 4
  for (int f = 0; f < F; ++f) {
    const __m256 t = _mm256_add_ps(acc[f], accm[f]);
    v[f] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // hsum8's first step
  }
  _MM_TRANSPOSE4_PS(v[0], v[1], v[2], v[3]);  // v[j] = lane j of every feature
  // hsum8's order per feature, (l0 + l2) + (l1 + l3), then the odd block's scalar term as tile_vnni<Q, 1> adds it
  const __m128 sums = _mm_add_ps(_mm_add_ps(v[0], v[2]), _mm_add_ps(v[1], v[3]));
  _mm_storeu_ps(out, _mm_add_ps(sums, _mm_load_ps(extra)));
}
#else
// The same sums in plain C++ (builds without AVX2).
template <int64_t Q, int R>
void tile(const QuantX& qx, int64_t m0, int64_t k_len, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
          float* out, int64_t n_out) {
  const int64_t nb = k_len / kBlock;
  const int64_t bb = block_bytes(Q);
  for (int64_t n = n0; n < n1; ++n) {
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + n * row_bytes + b * bb;
        const int8_t* xq = qx.q.data() + row * k_len + b * kBlock;
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) {
          int32_t wq;
          if constexpr (Q == kQ8_0) wq = static_cast<int8_t>(blk[2 + j]);
          else wq = (blk[(Q == kQ4_1 ? 4 : 2) + (j % 16)] >> (j < 16 ? 0 : 4)) & 0x0f;
          int32_t xv = xq[j];
          if constexpr (kTwoByteX<Q>) xv = 256 * xv + qx.r[row * k_len + b * kBlock + j];
          dot += wq * xv;
        }
        const float dw = half_at(blk);
        total += dw * qx.d[row * nb + b] * static_cast<float>(dot);
        if constexpr (Q == kQ4_1) total += half_at(blk + 2) * qx.s[row * nb + b];
        if constexpr (Q == kQ4_0) total -= dw * qx.c8[row * nb + b];
      }
      out[row * n_out + n] = total;
    }
  }
}
#endif

template <int64_t Q>
void run(const QuantX& qx, int64_t rows, int64_t k_len, const uint8_t* w, int64_t row_bytes, int64_t n_out, float* out) {
  at::parallel_for(0, n_out, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kChunk) {
      const int64_t n1 = std::min(end, n0 + kChunk);
      int64_t m = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if (qx.vnni) {
        if constexpr (Q == kQ8_0) {
          // gguf_q8_rows.cpp's tiles (a Q8_0 pair is more than one load), whose row bits do not depend on the row
          // count: the pair tile's did (its blocks summed in another order than the one-row tile's)
          raytp::q8_0_rows(qx.q.data(), qx.d.data(), rows, k_len, w, row_bytes, n0, n1, out, n_out);
        } else {
          for (; m + kRows <= rows; m += kRows) tile_vnni<Q, kRows>(qx, m, k_len, w, row_bytes, n0, n1, out, n_out);
          for (; m < rows; ++m) {
            int64_t n = n0;
            for (; n + kFeatures <= n1; n += kFeatures) q4_row_features<Q>(qx, m, k_len, w, row_bytes, n, out + m * n_out + n);
            tile_vnni<Q, 1>(qx, m, k_len, w, row_bytes, n, n1, out, n_out);
          }
        }
        continue;
      }
#endif
      for (; m + kRows <= rows; m += kRows) tile<Q, kRows>(qx, m, k_len, w, row_bytes, n0, n1, out, n_out);
      for (; m < rows; ++m) tile<Q, 1>(qx, m, k_len, w, row_bytes, n0, n1, out, n_out);
    }
  });
}

// A decode step's rows of a Q4_0 / Q4_1 layer on its packed copy (gguf_q4x16.cpp): threads take ranges of 16-feature
// groups, each row of x runs over a group while its bytes are in L1.
void run_q4x16(const QuantX& qx, int64_t rows, int64_t k_len, const uint8_t* packed, int64_t qtype, int64_t n_out,
               float* out) {
  const int64_t nb = k_len / kBlock;
  const float* e = qtype == kQ4_1 ? qx.s.data() : qx.c8.data();
  at::parallel_for(0, n_out / raytp::kX16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m = 0; m < rows; ++m)
        raytp::q4x16_row(qtype, qx.q.data() + m * k_len, qx.r.data() + m * k_len, qx.d.data() + m * nb, e + m * nb,
                         k_len, packed, g, g + 1, out + m * n_out);
  });
}

// A Q8_0 matrix's rows on its packed copy (gguf_q8x16.cpp), as run_q4x16 runs the Q4 layers'.
void run_q8x16(const QuantX& qx, int64_t rows, int64_t k_len, const uint8_t* packed, int64_t n_out, float* out) {
  const int64_t nb = k_len / kBlock;
  at::parallel_for(0, n_out / raytp::kX16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m = 0; m < rows; ++m)
        raytp::q8x16_row(qx.q.data() + m * k_len, qx.d.data() + m * nb, qx.qs.data() + m * nb, k_len, packed, g, g + 1,
                         out + m * n_out);
  });
}

// packed: the matrix's copy from gguf_q4x16_pack (Q4_0 / Q4_1) or gguf_q8x16_pack (Q8_0), taken by the integer road
// where given and non-empty.
// road: gguf_dequant_gemm.h's kRoad* (which road the rows take; kRoadByRows: by their count). out: where to write
// the [M, N] result (a contiguous float32 block, e.g. rows of a step's output that other calls fill), else a new
// tensor.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& packed,
                       int64_t road, const std::optional<at::Tensor>& out_arg) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "gguf_linear: x [M, K] and w [N, row bytes] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte, "gguf_linear: float32 x, uint8 w");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "gguf_linear: x needs a contiguous last dim, w must be contiguous");
  const int64_t rows = x.size(0), k_len = x.size(1), n_out = w.size(0);
  TORCH_CHECK(k_len % kBlock == 0, "gguf_linear: K = ", k_len, " is not a multiple of 32");
  const int64_t super_bytes = raytp::kquant_block_bytes(qtype);  // 0: a 32-block type
  TORCH_CHECK(super_bytes == 0 || k_len % raytp::kSuper == 0, "gguf_linear: K = ", k_len,
              " is not a multiple of 256 (a K-quant super-block)");
  const int64_t row_bytes = super_bytes ? k_len / raytp::kSuper * super_bytes : k_len / kBlock * block_bytes(qtype);
  TORCH_CHECK(w.size(1) == row_bytes, "gguf_linear: w rows hold ", w.size(1), " bytes, K = ", k_len, " needs ", row_bytes);
  if (out_arg.has_value())
    TORCH_CHECK(out_arg->dim() == 2 && out_arg->size(0) == rows && out_arg->size(1) == n_out &&
                    out_arg->scalar_type() == at::kFloat && out_arg->is_contiguous(),
                "gguf_linear: out must be a contiguous float32 [", rows, ", ", n_out, "]");
  const auto result = [&]() { return out_arg.has_value() ? *out_arg : at::empty({rows, n_out}, x.options()); };
  if (raytp::dequant_road(rows, road)) {  // a prefill chunk: W dequantized per chunk, fp32 FMA tiles
    at::Tensor out = result();
    raytp::gguf_dequant_linear(qtype, x.data_ptr<float>(), x.stride(0), rows, k_len, w.data_ptr<uint8_t>(), row_bytes,
                               n_out, out.data_ptr<float>());
    return out;
  }
  const int64_t nb = k_len / kBlock;
  const bool two_bytes = qtype == kQ4_0 || qtype == kQ4_1;  // kTwoByteX
  // The calling thread's buffers, kept from call to call: a decode step makes ~121 calls a token on a few KB each,
  // and allocating (and zeroing) nine vectors per call was a measurable part of the small matrices' calls.
  // (A reference: the worker threads of the loops below must see the caller's buffers, not their own.)
  thread_local QuantX buffers;
  QuantX& qx = buffers;
  qx.q.resize(rows * k_len);
  qx.r.resize(two_bytes ? rows * k_len : 0);
  qx.d.resize(rows * nb);
  qx.s.resize(rows * nb);
  qx.c8.resize(rows * nb);
  qx.qs.resize(rows * nb);
  qx.two = two_bytes;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  bool vnni = false;
#if defined(__AVX2__) && defined(__FMA__)
  vnni = super_bytes == 0 && use_vnni();  // the K-quant kernels read qx as it is
#endif
  // The pair layout feeds the VNNI pair tiles (Q4_0 / Q4_1 on the file's rows).
  const bool x16 = vnni && packed.has_value() && packed->numel() > 0;
  if (x16) {
    const int64_t packed_block = qtype == kQ8_0 ? raytp::kQ8x16BlockBytes : raytp::q4x16_block_bytes(qtype);
    TORCH_CHECK((qtype == kQ8_0 || qtype == kQ4_0 || qtype == kQ4_1) && n_out % raytp::kX16 == 0 &&
                    packed->is_contiguous() && packed->scalar_type() == at::kByte &&
                    packed->size(0) == n_out / raytp::kX16 && packed->size(1) == nb * packed_block,
                "gguf_linear: the packed copy does not match w");
  }
  const bool pairs = vnni && !x16 && qtype != kQ8_0;  // Q8_0 runs gguf_q8_rows.cpp's tile on q as it is
  qx.vnni = vnni;
  if (pairs) {
    qx.qv.resize(rows * k_len);
    if (two_bytes) qx.rv.resize(rows * k_len);
    qx.dx8.resize(rows * (nb / 2) * 8);
    qx.e8.resize(rows * (nb / 2) * 8);
  }
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / k_len), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* r = two_bytes ? qx.r.data() + m * k_len : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
      if (vnni)
        quantize_row_avx512(xp + m * ldx, k_len, qx.q.data() + m * k_len, r, qx.d.data() + m * nb, qx.s.data() + m * nb,
                            qx.c8.data() + m * nb, qx.qs.data() + m * nb);
      else
#endif
        quantize_row(xp + m * ldx, k_len, qx.q.data() + m * k_len, r, qx.d.data() + m * nb, qx.s.data() + m * nb,
                     qx.c8.data() + m * nb, qx.qs.data() + m * nb);
#if defined(__AVX2__) && defined(__FMA__)
      if (pairs) interleave_pairs(qx, m, k_len, qtype);
#endif
    }
  });
  at::Tensor out = result();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (x16) {
    if (qtype == kQ8_0) run_q8x16(qx, rows, k_len, packed->data_ptr<uint8_t>(), n_out, op);
    else run_q4x16(qx, rows, k_len, packed->data_ptr<uint8_t>(), qtype, n_out, op);
    return out;
  }
  switch (qtype) {
    case kQ8_0: run<kQ8_0>(qx, rows, k_len, wp, row_bytes, n_out, op); break;
    case kQ4_0: run<kQ4_0>(qx, rows, k_len, wp, row_bytes, n_out, op); break;
    case kQ4_1: run<kQ4_1>(qx, rows, k_len, wp, row_bytes, n_out, op); break;
    case raytp::kQ4_K:
    case raytp::kQ6_K:
      raytp::kquant_linear(qtype, qx.q.data(), qx.d.data(), qx.s.data(), rows, k_len, wp, n_out, op);
      break;
    default: block_bytes(qtype);  // raises
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) { m.def(
      "gguf_linear(Tensor x, Tensor w, int qtype, Tensor? packed=None, int road=0, Tensor(a!)? out=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("gguf_linear", &gguf_linear); }
