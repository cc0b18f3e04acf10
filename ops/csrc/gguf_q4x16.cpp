// The decode step's Q4_0 / Q4_1 product on a layout repacked at load: 16 output features interleaved per block
// (issue 39: the default Q4_1 GGUF's decode at >= 3x the fp32 step).
//
// Why (measured, docs/benchmarks.md): with the file's own layout a decode step's Q4_1 products were bound by
// instructions, not bytes: the fp32 panels stream ~23 GB/s on this machine's two cores where the Q4_1 tiles
// moved ~11. gguf_gemm.cpp's pair tiles spend ~17 vector instructions per feature and 64 weights: one masked
// load, two word permutes to lay a block pair's nibbles and scales out, the unpacking, two vpdpbusd, a 16 -> 8
// lane fold, a convert, the scale product and two FMAs, and a horizontal sum per feature at the end.
//
// The layout: per group of 16 features and per 32-weight block, 256 bytes of nibbles then the 16 features' fp16 d
// (and, Q4_1, their 16 fp16 m): 320 bytes (Q4_0: 288), the same bytes as the 16 blocks in the file. Byte 4 v + t
// (v < 4, t < 4) of feature j's block (weights 4 v + t in its low nibble, 16 + 4 v + t in its high one) sits at
// 64 v + 4 j + t, so a 64-byte load masked to low nibbles holds weights 4 v .. 4 v + 3 of all 16 features, one
// feature per int32 lane, and vpdpbusd against x's 4 matching bytes broadcast sums them into that feature's lane.
// Eight such products (two byte planes of x: 16) give all 16 features' integer block dots with no horizontal
// sum. A block's four 8-weight dots (two byte planes of x: 16 vpdpbusd) are converted and FMA'd by 16 scales (one
// vcvtph2ps) into the accumulator lanes the file-layout tiles use, so ~55 vector instructions per 16 features and
// block, against ~136. A thread reads its groups' bytes as one forward stream.
//
// Numerics: bit-identical to gguf_gemm.cpp's tiles on the file's layout (the same exact integer dots, scales and
// float sums in the same order, `row_groups` below), so a model's outputs do not change with the layout: with
// another float order (one FMA per block) the default model's greedy tokens left the dequantized fp32 model's at
// token 24 of 256 where the file-layout tiles follow it all 256. The file's rows stay for the prefill road.
#include "gguf_q4x16.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/Exception.h>

#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace raytp {

namespace {
constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3;  // GGML's type ids
constexpr int64_t kNibbles = 256;        // a group's block of nibbles: 16 features x 16 bytes
}  // namespace

inline int64_t raw_block_bytes(int64_t qtype) {  // a block in the file
  return qtype == kQ4_1 ? 20 : 18; }

int64_t q4x16_block_bytes(int64_t qtype) {
  if (qtype == kQ4_1) return kNibbles + 2 * 2 * kX16;  // + d[16], m[16]
  if (qtype == kQ4_0) return kNibbles + 2 * kX16;      // + d[16]
  return 0;
}

void q4x16_pack(int64_t qtype, const uint8_t* raw, int64_t n, int64_t k_len, uint8_t* packed) {
  const int64_t bb = q4x16_block_bytes(qtype), rb = raw_block_bytes(qtype);
  TORCH_CHECK(bb > 0 && n % kX16 == 0 && k_len % kBlock == 0, "q4x16_pack: Q4_0 / Q4_1, N % 16 == 0, K % 32 == 0");
  const int64_t nb = k_len / kBlock, nibbles_at = qtype == kQ4_1 ? 4 : 2;
  for (int64_t g = 0; g < n / kX16; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* dst = packed + (g * nb + b) * bb;
      for (int64_t j = 0; j < kX16; ++j) {
        const uint8_t* src = raw + ((g * kX16 + j) * nb + b) * rb;
        for (int64_t t = 0; t < 16; ++t) dst[(t / 4) * 64 + j * 4 + t % 4] = src[nibbles_at + t];
        std::memcpy(dst + kNibbles + 2 * j, src, 2);                                   // d
        if (qtype == kQ4_1) std::memcpy(dst + kNibbles + 2 * kX16 + 2 * j, src + 2, 2);  // m
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
namespace {
#define RAYTP_X16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// W prefetched this many bytes ahead, every line of a block (gguf_gemm.cpp's kAhead). One forward stream per thread,
// yet the hardware prefetcher alone left this kernel 9% slower than the file's layout streaming 30 layers from
// memory (1 thread, thread CPU time, shared machine); with it 10-14% faster; 1 KB and 8 KB ahead measured the same.
constexpr int64_t kAhead = 4096;

RAYTP_X16 inline __m512i bcast(const int8_t* p) {  // 4 bytes of x in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Each feature's float sums are those of gguf_gemm.cpp's pair tiles (tile_vnni<Q, 1>, q4_row_features), lane for
// lane: there a feature's 8 accumulator lanes hold, for even blocks (lanes v < 4) and odd ones (lanes 4 + v), the
// scaled integer dot of weights 4 v .. 4 v + 3 and 16 + 4 v .. 16 + 4 v + 3, and its offset lanes m * sum(x) / 4 per
// parity; an odd last block puts its two nibble halves in lanes v and 4 + v and its offset in a scalar added after
// the horizontal sum, (t0 + t4 + t2 + t6) + (t1 + t5 + t3 + t7) in hsum8's order. Here A[i] is lane i for 16
// features, so every output has the file-layout tiles' bits (tests/ops/test_gguf_q4x16.py checks torch.equal).
template <int64_t Q>
RAYTP_X16 void row_groups(const int8_t* xh, const int8_t* xl, const float* d, const float* e, int64_t k_len,
                          const uint8_t* packed, int64_t g0, int64_t g1, float* out) {
  constexpr int64_t bb = Q == kQ4_1 ? 320 : 288;
  const int64_t nb = k_len / kBlock;
  const int64_t paired = nb - nb % 2;  // blocks in pairs; an odd last one apart
  const __m512i mask = _mm512_set1_epi8(0x0f);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* p = packed + g * nb * bb;
    __m512 acc[8], accm[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    accm[0] = accm[1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < paired; ++b) {
      const uint8_t* blk = p + b * bb;
#pragma GCC unroll 5
      for (int64_t c = 0; c < bb; c += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + c), _MM_HINT_T0);
      const int8_t* hb = xh + b * kBlock;
      const int8_t* lb = xl + b * kBlock;
      const int par = static_cast<int>(b & 1);
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kNibbles)));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(d[b]));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(blk + 64 * v);
        const __m512i wl = _mm512_and_si512(raw, mask);                         // weights 4 v .. 4 v + 3
        const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);  // weights 16 + 4 v ..
        const __m512i h = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, bcast(hb + 4 * v)), wh,
                                              bcast(hb + 16 + 4 * v));
        const __m512i l = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, bcast(lb + 4 * v)), wh,
                                              bcast(lb + 16 + 4 * v));
        // 256 (w . hi) + (w . lo) over the 8 weights: exact (|.| < 2^24, so its float is exact too)
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
        acc[4 * par + v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[4 * par + v]);
      }
      const __m512 ex = _mm512_set1_ps(e[b] / 4.f);
      if constexpr (Q == kQ4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kNibbles + 32)));
        accm[par] = _mm512_fmadd_ps(m, ex, accm[par]);
      } else {
        accm[par] = _mm512_fnmadd_ps(dw, ex, accm[par]);
      }
    }
    __m512 extra = _mm512_setzero_ps();
    if (nb % 2) {  // the odd last block: nibble halves in lanes v and 4 + v, the offset after the sum
      const int64_t b = nb - 1;
      const uint8_t* blk = p + b * bb;
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kNibbles)));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(d[b]));
      const int8_t* hb = xh + b * kBlock;
      const int8_t* lb = xl + b * kBlock;
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(blk + 64 * v);
        const __m512i half[2] = {_mm512_and_si512(raw, mask), _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask)};
        for (int hi = 0; hi < 2; ++hi) {
          const int64_t at = 16 * hi + 4 * v;
          const __m512i dot =
              _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), half[hi], bcast(hb + at)), 8),
                               _mm512_dpbusd_epi32(_mm512_setzero_si512(), half[hi], bcast(lb + at)));
          acc[4 * hi + v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[4 * hi + v]);
        }
      }
      if constexpr (Q == kQ4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kNibbles + 32)));
        extra = _mm512_mul_ps(m, _mm512_set1_ps(e[b]));
      } else {
        extra = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dw, _mm512_set1_ps(e[b])));
      }
    }
    __m512 t[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) t[i] = _mm512_add_ps(acc[i], accm[i / 4]);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(t[0], t[4]), _mm512_add_ps(t[2], t[6])),
                                     _mm512_add_ps(_mm512_add_ps(t[1], t[5]), _mm512_add_ps(t[3], t[7])));
    _mm512_storeu_ps(out + g * kX16, _mm512_add_ps(sum, extra));
  }
}

bool vnni() {
  static const bool yes =
      use_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return yes;
}
}  // namespace

bool q4x16_supported() { return vnni(); }

void q4x16_row(int64_t qtype, const int8_t* xh, const int8_t* xl, const float* d, const float* e, int64_t k_len,
               const uint8_t* packed, int64_t g0, int64_t g1, float* out) {
  TORCH_CHECK(vnni(), "q4x16_row: needs AVX-512 VNNI");
  if (qtype == kQ4_1) row_groups<kQ4_1>(xh, xl, d, e, k_len, packed, g0, g1, out);
  else if (qtype == kQ4_0) row_groups<kQ4_0>(xh, xl, d, e, k_len, packed, g0, g1, out);
  else TORCH_CHECK(false, "q4x16_row: GGML type ", qtype, " has no packed layout");
}
#else
bool q4x16_supported() { return false; }

void q4x16_row(int64_t, const int8_t*, const int8_t*, const float*, const float*, int64_t, const uint8_t*, int64_t,
               int64_t, float*) {
  TORCH_CHECK(false, "q4x16_row: needs the AVX2 build and AVX-512 VNNI");
}
#endif

}  // namespace raytp

// ---- the op that packs a layer's rows at load (model_exec/layers/quantization/gguf.py) -------------------------

namespace {
// w [N, K / 32 * block bytes] uint8 of a Q4_0 / Q4_1 layer -> its packed copy [N / 16, K / 32 * packed block bytes];
// an empty tensor where the packed kernel cannot run it (no AVX-512 VNNI, another type, N % 16 != 0): the layer
// then keeps the file's layout alone.
at::Tensor gguf_q4x16_pack(const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "gguf_q4x16_pack: w [N, row bytes] uint8");
  const int64_t bb = raytp::q4x16_block_bytes(qtype);
  const int64_t n = w.size(0);
  if (bb == 0 || n % raytp::kX16 != 0 || !raytp::q4x16_supported()) return at::empty({0}, w.options());
  const int64_t rb = raytp::raw_block_bytes(qtype);
  TORCH_CHECK(w.size(1) % rb == 0, "gguf_q4x16_pack: a row of ", w.size(1), " bytes is not whole blocks");
  const int64_t nb = w.size(1) / rb;
  at::Tensor packed = at::empty({n / raytp::kX16, nb * bb}, w.options());
  raytp::q4x16_pack(qtype, w.data_ptr<uint8_t>(), n, nb * 32, packed.data_ptr<uint8_t>());
  return packed;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) { m.def("gguf_q4x16_pack(Tensor w, int qtype) -> Tensor"); }

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("gguf_q4x16_pack", &gguf_q4x16_pack); }
