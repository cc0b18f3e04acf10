// Q8_0 weights repacked at load for the integer road (the LM head of the Q4 GGUF files, a Q8_0 file's layers,
// `quantization="int8"`): 16 output features interleaved per block, as gguf_q4x16.cpp does for Q4_0 / Q4_1.
//
// Why (measured, docs/benchmarks.md): the engine runs every generated row on the integer road, whatever the batch
// (model_exec/layers/quantization/row_roads.py), so the LM head multiplies one row per sampled sequence there. On
// the file's layout a Q8_0 block is 34 bytes, more than one 64-byte load holds in pairs, and a row cost ~6 vector
// instructions per block and feature: the 49152 x 576 head took 0.36 ms a row at 64 rows, twice the dequantizing
// road's 0.27 and the fp32 panels' 0.30.
//
// The layout: per group of 16 features and per 32-weight block, 512 bytes of weights stored as w + 128 (unsigned),
// then the 16 features' fp16 d: 544 bytes, the same as the 16 blocks in the file. Byte 4 v + t (v < 8, t < 4) of
// feature j's block sits at 64 v + 4 j + t, so one 64-byte load holds weights 4 v .. 4 v + 3 of all 16 features,
// one feature per int32 lane, and vpdpbusd against x's 4 matching bytes broadcast adds their products into that
// feature's lane: eight of them give the 16 features' block dots, with no horizontal sum. vpdpbusd multiplies
// unsigned by signed bytes, so the weights go in as w + 128 and each lane starts from -128 times the sum of x's
// block (an exact int32: the dot is d_w dx sum w q exactly as the file-layout tiles have it).
//
// Numerics: each feature's float sum runs over blocks in one order (block b into accumulator b % 4, summed
// (a0 + a1) + (a2 + a3)), whatever the rows of the call: a row's bits never depend on its neighbours'. They are
// not the file-layout tiles' bits (another float order): a layer runs on one of the two, decided at load.
#include "gguf_q8x16.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstring>

#include "gguf_q4x16.h"  // kX16, q4x16_supported (the same CPU features)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace raytp {

namespace {
constexpr int64_t kBlock = 32;
constexpr int64_t kRawBytes = 34;  // a Q8_0 block in the file: fp16 d, 32 x int8
constexpr int64_t kWeights = 512;  // a group's block of weights: 16 features x 32 bytes
}  // namespace

void q8x16_pack(const uint8_t* raw, int64_t n, int64_t k_len, uint8_t* packed) {
  TORCH_CHECK(n % kX16 == 0 && k_len % kBlock == 0, "q8x16_pack: N % 16 == 0, K % 32 == 0");
  const int64_t nb = k_len / kBlock;
  for (int64_t g = 0; g < n / kX16; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* dst = packed + (g * nb + b) * kQ8x16BlockBytes;
      for (int64_t j = 0; j < kX16; ++j) {
        const uint8_t* src = raw + ((g * kX16 + j) * nb + b) * kRawBytes;
        for (int64_t t = 0; t < kBlock; ++t) dst[(t / 4) * 64 + j * 4 + t % 4] = static_cast<uint8_t>(src[2 + t] ^ 0x80);
        std::memcpy(dst + kWeights + 2 * j, src, 2);  // d
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
namespace {
#define RAYTP_X16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

constexpr int64_t kAhead = 4096;  // W prefetched this many bytes ahead (gguf_q4x16.cpp's choice)

RAYTP_X16 inline __m512i bcast(const int8_t* p) {  // 4 bytes of x in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
}  // namespace

RAYTP_X16 void q8x16_row(const int8_t* qx, const float* dx, const int32_t* qsum, int64_t k_len, const uint8_t* packed,
                         int64_t g0, int64_t g1, float* out) {
  const int64_t nb = k_len / kBlock;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* p = packed + g * nb * kQ8x16BlockBytes;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = p + b * kQ8x16BlockBytes;
#pragma GCC unroll 9
      for (int64_t c = 0; c < kQ8x16BlockBytes; c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + c), _MM_HINT_T0);
      const int8_t* xb = qx + b * kBlock;
      __m512i dot = _mm512_set1_epi32(-128 * qsum[b]);  // (w + 128) . x - 128 sum x = w . x
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v)
        dot = _mm512_dpbusd_epi32(dot, _mm512_loadu_si512(blk + 64 * v), bcast(xb + 4 * v));
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kWeights)));
      acc[b % 4] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(dx[b])), acc[b % 4]);
    }
    _mm512_storeu_ps(out + g * kX16, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  }
}
#else
void q8x16_row(const int8_t*, const float*, const int32_t*, int64_t, const uint8_t*, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "q8x16_row: needs the AVX2 build and AVX-512 VNNI");
}
#endif

}  // namespace raytp

// ---- the op that packs a Q8_0 matrix at load (model_exec/layers/quantization/gguf.py) -----------------------------

namespace {
// w [N, K / 32 * 34] uint8 of Q8_0 rows -> its packed copy [N / 16, K / 32 * 544]; an empty tensor where the packed
// kernel cannot run it (no AVX-512 VNNI, N % 16 != 0): the matrix then keeps the file's layout alone.
at::Tensor gguf_q8x16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "gguf_q8x16_pack: w [N, row bytes] uint8");
  const int64_t n = w.size(0);
  if (n % raytp::kX16 != 0 || !raytp::q4x16_supported()) return at::empty({0}, w.options());
  TORCH_CHECK(w.size(1) % raytp::kRawBytes == 0, "gguf_q8x16_pack: a row of ", w.size(1), " bytes is not whole blocks");
  const int64_t nb = w.size(1) / raytp::kRawBytes;
  at::Tensor packed = at::empty({n / raytp::kX16, nb * raytp::kQ8x16BlockBytes}, w.options());
  raytp::q8x16_pack(w.data_ptr<uint8_t>(), n, nb * 32, packed.data_ptr<uint8_t>());
  return packed;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) { m.def("gguf_q8x16_pack(Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("gguf_q8x16_pack", &gguf_q8x16_pack); }
