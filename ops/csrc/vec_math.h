// Vector math shared by the C++ CPU kernels (ops/csrc/*.cpp, ops/attention/csrc/*.cpp). Include it
// where __AVX2__ and __FMA__ are defined (the loader passes -mavx2 -mfma when the machine has them).
// The AVX-512 functions carry their own target attribute: the files are built for AVX2, and a kernel
// calls its RAYTP_AVX512 variant only when `use_avx512()` says the CPU runs it.
#pragma once

#include <immintrin.h>

#include <cstdlib>

#define RAYTP_AVX512 __attribute__((target("avx512f")))

namespace raytp {

// AVX-512F on this CPU, unless RAYTP_CPU_NO_AVX512 is set (the tests use it to compare both paths).
inline bool use_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && std::getenv("RAYTP_CPU_NO_AVX512") == nullptr;
  return yes;
}

// The sum of 8 lanes.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial, scale
// by 2^n), about 1 ulp over the clamped range; below -87.3 the result is flushed towards 0
// (~1e-38), above 88.38 it saturates.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// exp8's polynomial on 16 lanes (same constants, same clamping).
RAYTP_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

// Attention logit soft-capping (Gemma 2): cap * tanh(x / cap), with tanh(y) = 1 - 2 / (e^2y + 1).
// exp8's clamping keeps it finite and exactly +-cap far out; near 0 the absolute error is about
// cap * 1e-7 (the subtraction), which is what a softmax input's error means.
inline __m256 soft_cap8(__m256 x, __m256 cap, __m256 two_over_cap) {
  const __m256 e = exp8(_mm256_mul_ps(x, two_over_cap));
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_mul_ps(cap, _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one))));
}

// soft_cap8 on 16 lanes.
RAYTP_AVX512 inline __m512 soft_cap16(__m512 x, __m512 cap, __m512 two_over_cap) {
  const __m512 e = exp16(_mm512_mul_ps(x, two_over_cap));
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_mul_ps(cap, _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one))));
}

// silu(g) * u = g / (1 + e^-g) * u, as torch computes silu; ops/csrc/fused_layers.cpp's SiLU-and-mul
// and panel_gemm.cpp's gated GEMM both use these, so the two give the same bits.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  return _mm256_mul_ps(silu, u);
}

// silu_mul8 on 16 lanes (exp16 gives exp8's bits, so this gives silu_mul8's).
RAYTP_AVX512 inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(silu, u);
}

}  // namespace raytp
