// The many-row (prefill) road of the GGUF linear: W's blocks dequantized to fp32 panels one chunk at a time and
// multiplied on the FMA units (gguf_dequant_gemm.cpp); gguf_gemm.cpp calls it above kDequantRows rows of x.
#pragma once

#include <cstdint>

namespace raytp {

// Rows of x from which the dequantizing road runs (where the CPU has AVX-512F): below it the integer tiles
// of gguf_gemm.cpp are faster, since dequantizing a chunk of W costs about as much as ~8 rows of its product.
constexpr int64_t kDequantRows = 16;

// The road a gguf_linear call asks for (its `road` argument): kRoadByRows picks by the call's row count (below);
// the engine asks for a row's road by the row's kind (model_exec/layers/quantization/row_roads.py), so a row's
// bits never depend on which rows share its step.
constexpr int64_t kRoadByRows = 0;
constexpr int64_t kRoadInteger = 1;   // the integer tiles (x quantized per block), whatever the row count
constexpr int64_t kRoadDequant = 2;   // the dequantizing road where the CPU has AVX-512F (else the integer tiles)

// True when gguf_dequant_linear runs for a call of `rows` rows asking for `road` on this CPU: AVX-512F, and
// kRoadDequant, or kRoadByRows with rows >= kDequantRows or the environment's RAYTP_GGUF_DEQUANT_ROWS (read on
// every call: benchmarks/gguf_kernels.py times both roads in one process by setting it; 0 or unset: kDequantRows).
bool dequant_road(int64_t rows, int64_t road);

// out[rows, n_out] = x W^T for W's rows `w` [n_out, row_bytes] of GGML type `qtype` (Q8_0, Q4_0, Q4_1, Q4_K,
// Q6_K), x [rows, K] float32 with row stride ldx. K is a multiple of the type's block. The same sums as the
// product with the dequantized weights, to float32 rounding.
void gguf_dequant_linear(int64_t qtype, const float* x, int64_t ldx, int64_t rows, int64_t k_len, const uint8_t* w,
                         int64_t row_bytes, int64_t n_out, float* out);

}  // namespace raytp
