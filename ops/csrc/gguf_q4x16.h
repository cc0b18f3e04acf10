// Q4_0 / Q4_1 weights repacked at load for the decode step (gguf_q4x16.cpp): 16 output features interleaved per
// block, so one vpdpbusd lane is one feature and a block's dot needs no horizontal sum. gguf_gemm.cpp quantizes x
// and calls `q4x16_rows` for the rows of a decode step where the layer carries the packed copy.
#pragma once

#include <cstdint>

namespace raytp {

constexpr int64_t kX16 = 16;  // output features per packed group

// Bytes of one group's block (16 features x 32 weights): 256 of nibbles, then 16 fp16 d (and 16 fp16 m for Q4_1).
// 0 for a type without a packed layout.
int64_t q4x16_block_bytes(int64_t qtype);

// True where the packed kernel runs (AVX-512 VNNI, unless RAYTP_CPU_NO_AVX512 is set).
bool q4x16_supported();

// raw [n, k / 32 blocks] GGUF rows -> packed [n / 16 groups][k / 32 blocks][q4x16_block_bytes]; n % 16 == 0.
void q4x16_pack(int64_t qtype, const uint8_t* raw, int64_t n, int64_t k_len, uint8_t* packed);

// out[16 g + j] for groups g in [g0, g1) = x W^T of one row of x, quantized per 32-block on gguf_gemm.cpp's
// 16-bit grid: xh / xl int8 [K] (X's high and low bytes), d [K / 32] (grid steps), e [K / 32] (Q4_1: the float
// sum of x per block; Q4_0: 8 d times the sum of X per block). The integer dots are gguf_gemm.cpp's exactly; only
// the float sum over blocks runs in another order (block by block).
void q4x16_row(int64_t qtype, const int8_t* xh, const int8_t* xl, const float* d, const float* e, int64_t k_len,
               const uint8_t* packed, int64_t g0, int64_t g1, float* out);

}  // namespace raytp
