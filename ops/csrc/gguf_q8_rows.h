// Q8_0's few-row (decode) tile of the GGUF linear (gguf_q8_rows.cpp); gguf_gemm.cpp calls it for the rows
// left over from its 4-row tiles where the CPU has AVX-512 VNNI.
#pragma once

#include <cstdint>

namespace raytp {

// out[n * ldo] for n in [n0, n1) = x W^T of one row of x, quantized per 32-block as gguf_gemm.cpp does (qx int8
// [K], dx [K / 32] its grid steps), against Q8_0 rows `w` of row_bytes each. Needs AVX-512 VNNI (the caller checks).
void q8_0_row(const int8_t* qx, const float* dx, int64_t k_len, const uint8_t* w, int64_t row_bytes, int64_t n0,
              int64_t n1, float* out, int64_t ldo);

}  // namespace raytp
