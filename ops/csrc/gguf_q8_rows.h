// Q8_0's tiles of the GGUF linear's integer road (gguf_q8_rows.cpp); gguf_gemm.cpp calls them for every row where
// the CPU has AVX-512 VNNI.
#pragma once

#include <cstdint>

namespace raytp {

// out[m * n_out + n] for m < rows, n in [n0, n1) = x W^T of `rows` rows of x, quantized per 32-block as
// gguf_gemm.cpp does (qx int8 [rows, K], dx [rows, K / 32] their grid steps), against Q8_0 rows `w` of row_bytes
// each. Each row's bits are the same whatever `rows`. Needs AVX-512 VNNI (the caller checks).
void q8_0_rows(const int8_t* qx, const float* dx, int64_t rows, int64_t k_len, const uint8_t* w, int64_t row_bytes,
               int64_t n0, int64_t n1, float* out, int64_t n_out);

}  // namespace raytp
