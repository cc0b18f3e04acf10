// Q8_0 weights repacked at load for the integer road (gguf_q8x16.cpp): 16 output features interleaved per block, so
// one vpdpbusd lane is one feature. gguf_gemm.cpp quantizes x and calls `q8x16_row` for each row where the matrix
// carries the packed copy.
#pragma once

#include <cstdint>

namespace raytp {

// Bytes of one group's block (16 features x 32 weights): 512 of weights (w + 128), then 16 fp16 d.
constexpr int64_t kQ8x16BlockBytes = 512 + 2 * 16;

// raw [n, k / 32 Q8_0 blocks] -> packed [n / 16 groups][k / 32 blocks][kQ8x16BlockBytes]; n % 16 == 0.
void q8x16_pack(const uint8_t* raw, int64_t n, int64_t k_len, uint8_t* packed);

// out[16 g + j] for groups g in [g0, g1) = x W^T of one row of x quantized per 32-block to int8 as gguf_gemm.cpp
// does: qx [K], dx [K / 32] (grid steps), qsum [K / 32] (the sum of qx per block). Needs AVX-512 VNNI.
void q8x16_row(const int8_t* qx, const float* dx, const int32_t* qsum, int64_t k_len, const uint8_t* packed, int64_t g0,
               int64_t g1, float* out);

}  // namespace raytp
