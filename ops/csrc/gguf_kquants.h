// GGML's K-quant super-blocks (Q4_K, Q6_K) for the GGUF linear (gguf_gemm.cpp, which quantizes x and calls
// these; the kernels live in gguf_kquants.cpp).
#pragma once

#include <cstdint>

namespace raytp {

// GGML type ids (ggml.h) and their super-blocks: 256 weights each
constexpr int64_t kQ4_K = 12, kQ6_K = 14;
constexpr int64_t kSuper = 256;

// bytes per super-block of a K-quant type, 0 for any other type
int64_t kquant_block_bytes(int64_t qtype);

// out[rows, n_out] = x W^T for W's rows `w` [n_out, K / 256 * block bytes] of K-quant type `qtype`, from x
// quantized per 32-block as gguf_gemm.cpp does it: qx int8 [rows, K], dx [rows, K / 32] its scales, sx
// [rows, K / 32] the float sums of x per 32-block. K is a multiple of 256.
void kquant_linear(int64_t qtype, const int8_t* qx, const float* dx, const float* sx, int64_t rows, int64_t k_len,
                   const uint8_t* w, int64_t n_out, float* out);

}  // namespace raytp
