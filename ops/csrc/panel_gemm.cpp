// y = x W^T for any number of rows of x (a decode step of one sequence up to a prefill chunk), with W
// prepacked in 16-wide panels: the fp32 CPU path of every linear layer and the LM head.
//
// Layout: W [N, K] is stored as [ceil(N / 16), K, 16]: 16 output features side by side for every
// input feature, the last panel zero-padded. For every k a tile of MB rows x NP panels broadcasts
// x[m, k] against the panels' k-th rows and fused-multiply-adds into MB x NP x 16 accumulators held
// in registers: W is read as sequential streams and no horizontal sums are needed.
//
// Batch invariance (the decision that shapes this file): every output element is one accumulator,
// zeroed, then fused-multiply-added over k = 0, 1, ..., K-1 in order, whatever tile it sits in, the
// number of rows in the call, the row blocking, the thread split or the vector width. So a row's
// result has the same bits whether it shares its step with 0 or 500 other rows (the batch jobs'
// byte-identical re-runs and their parity with the HTTP server rely on it, tests/batch), and the
// AVX-512 and AVX2 paths agree bit for bit. Tiles only choose how many such chains run side by side:
// many (12 rows x 2 panels with AVX-512, 6 x 1 with AVX2) for prefill chunks and large decode
// batches, where the FMA units are the limit; few rows x 4 panels for a decode step of one or two
// sequences, where the time is streaming W from memory once.
//
// With AVX-512, a call of 12+ rows (a prefill chunk) packs x's 12-row groups into k-major strips, so a
// bulk tile's 12 broadcasts per k read one run of 48 bytes, and its threads claim chunks of panels one
// at a time instead of splitting them in halves (claim_chunks). Measured on the 2-core Sapphire Rapids
// VM (shared: one thread's CPU time), SmolLM2-135M's 121 matrices, medians of 9 interleaved rounds, ms,
// previous kernel (unpacked x, static halves) / this one / oneDNN's packed layout: 16 rows 49.8 / 50.6 /
// 74.9, 64 rows 144 / 137 / 154, 256 rows 606 / 549 / 579 (minima 581 / 523 / 501), 512 rows 1146 /
// 1069 / 1033 (minima 1134 / 1059 / 993); 1-6 rows unchanged. So still 3-7% behind oneDNN on one
// core from 256 rows. Tried and measured no better (one thread, 192 rows): 8x3 and 6x4 tiles (fewer
// loads per FMA: within 1% of 12x2), blocking k so a pair's W stays in L1 (3-5% slower), unrolling k,
// prefetching 8-64 rows ahead instead of 16, row blocks of 48 or 192 (within noise of 96).
//
// x [M, K] with a contiguous last dim, panels [G, K, 16] contiguous, out [M, N] fresh, fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: two AVX2 vectors, one AVX-512 vector
// Panels per parallel chunk at least: 4 panels of K=576 are 147 KB of W, ~10 us on one core.
constexpr int64_t kGrain = 4;
// Rows of x per block: a block (rows x K floats) is re-read for every panel, so it should stay in
// the core's L2 (1-2 MB): 96 x 1536 x 4 B = 590 KB for the widest K of SmolLM2 (down_proj).
// 48 and 192 measured the same within noise (Ice Lake; again with the strips on Sapphire Rapids).
constexpr int64_t kRowBlock = 96;
// Software prefetch of W this many k-rows (64 B each) ahead, in the tiles that are compute-bound
// enough for the hardware prefetcher to fall behind: 6 rows, 1 panel ~20% faster than without at
// 6-16 rows; no gain (slightly worse) in the 1-2 row, 4-panel tiles, which therefore skip it.
constexpr int64_t kPrefetchRows = 16;
// Panels per chunk (AVX2, and AVX-512 under 12 rows; pick_chunk sizes the AVX-512 bulk's claimed
// chunks): a thread runs every row tile of a block (the 12- or 6-row bulk, then the 1-11 row
// remainder) on one chunk of W before the next, so the remainder re-reads the chunk from L2
// (4 x 1536 x 64 B = 393 KB at most here) instead of streaming the thread's whole share of W again.
// Measured on a 2-core Ice Lake VM, SmolLM2's 121 matrices, AVX-512, against streaming the share again
// (interleaved medians of 7, same bits): 16 rows 51 -> 39 ms, 20 rows 53 -> 43, 40 rows 86 -> 77,
// 64 rows 142 -> 125; 1-12 rows (no bulk tile) and 100 (its 4 rows are a row block of their own) unchanged.
constexpr int64_t kChunk = 4;
constexpr int64_t kChunk3 = 6;  // for the AVX-512 remainders of 7-8 rows, 3 panels wide (2 panels: ~10% slower at 8 rows)
// The AVX-512 bulk tile's rows, and the most floats of x packed into its strips at once (8 MB: a
// 512-row prefill chunk at K = 4096; more rows go in slabs, one parallel region each).
constexpr int64_t kBulkRows = 12;
constexpr int64_t kStripFloats = int64_t{2} << 20;

struct Out {
  float* ptr;      // out[row 0 of the tile, column 0 of the tile's first panel]
  int64_t ld;      // out's row stride
  int64_t n_left;  // output features from the tile's first column to the end of the row
};

// Copies one row of one panel from the tile's buffer; the matrix's last panel may be partial.
inline void store_panel(float* dst, int64_t cols, const float* lanes) {
  std::copy(lanes, lanes + std::min<int64_t>(cols, kPanel), dst);
}

#if defined(__AVX2__) && defined(__FMA__)
// The `#pragma GCC unroll`s matter: GCC keeps `acc` in registers only when these loops are unrolled
// before it decides, otherwise every FMA goes through the stack (2x slower, seen in the assembly).
template <int MB, int NP>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t k_len, Out out) {
  const int64_t panel_stride = k_len * kPanel;
  __m256 acc[MB][NP][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p][0] = acc[m][p][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    if constexpr (NP == 1) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
      const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
        acc[m][0][0] = _mm256_fmadd_ps(xb, w0, acc[m][0][0]);
        acc[m][0][1] = _mm256_fmadd_ps(xb, w1, acc[m][0][1]);
      }
    } else {
      __m256 xb[MB];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) xb[m] = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const float* wk = w + p * panel_stride + k * kPanel;
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          acc[m][p][0] = _mm256_fmadd_ps(xb[m], w0, acc[m][p][0]);
          acc[m][p][1] = _mm256_fmadd_ps(xb[m], w1, acc[m][p][1]);
        }
      }
    }
  }
  alignas(32) float res[MB][NP][kPanel];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      _mm256_store_ps(res[m][p], acc[m][p][0]);
      _mm256_store_ps(res[m][p] + 8, acc[m][p][1]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int p = 0; p < NP; ++p) store_panel(out.ptr + m * out.ld + p * kPanel, out.n_left - p * kPanel, res[m][p]);
}

// MB rows against panels [g_begin, g_end): NP panels per tile, then the remainder one by one.
template <int MB, int NP>
void tiles(const float* x, int64_t ldx, const float* wp, int64_t k_len, int64_t g_begin, int64_t g_end, float* op,
           int64_t ldo, int64_t n) {
  int64_t g = g_begin;
  for (; g + NP <= g_end; g += NP) tile<MB, NP>(x, ldx, wp + g * k_len * kPanel, k_len, {op + g * kPanel, ldo, n - g * kPanel});
  for (; g < g_end; ++g) tile<MB, 1>(x, ldx, wp + g * k_len * kPanel, k_len, {op + g * kPanel, ldo, n - g * kPanel});
}

void block_avx2(const float* x, int64_t ldx, int64_t rows, const float* wp, int64_t k_len, int64_t g_begin,
                int64_t g_end, float* op, int64_t ldo, int64_t n) {
  const int64_t full = rows / 6 * 6;
  const float* xt = x + full * ldx;
  float* ot = op + full * ldo;
  for (int64_t c = g_begin; c < g_end; c += kChunk) {
    const int64_t c_end = std::min(c + kChunk, g_end);
    for (int64_t g = c; g < c_end; ++g) {
      const float* w = wp + g * k_len * kPanel;
      for (int64_t m = 0; m < full; m += 6) tile<6, 1>(x + m * ldx, ldx, w, k_len, {op + m * ldo + g * kPanel, ldo, n - g * kPanel});
    }
    switch (rows - full) {  // the remaining 1-5 rows, on the chunk's panels while they are in L2
      case 1: tiles<1, 4>(xt, ldx, wp, k_len, c, c_end, ot, ldo, n); break;
      case 2: tiles<2, 2>(xt, ldx, wp, k_len, c, c_end, ot, ldo, n); break;
      case 3: tiles<3, 1>(xt, ldx, wp, k_len, c, c_end, ot, ldo, n); break;
      case 4: tiles<4, 1>(xt, ldx, wp, k_len, c, c_end, ot, ldo, n); break;
      case 5: tiles<5, 1>(xt, ldx, wp, k_len, c, c_end, ot, ldo, n); break;
      default: break;
    }
  }
}

// The same chains with 512-bit vectors where the CPU has AVX-512F (checked at run time; the file is
// built for AVX2, these functions alone for AVX-512): a vector is a whole panel row, and the 32
// registers hold a 12-row x 2-panel tile (24 accumulators, 2 loads of W and 12 broadcasts of x per k).
//
// `Packed`: x is a strip [k][MB] (pack_strip) instead of MB rows `ldx` apart, so the tile's broadcasts
// read one 48-byte run per k, one stream, instead of 12 streams next to W's. The bulk 12-row tiles read
// strips; the 1-11 row tiles (a decode step, the rows left over by the bulk) read x in place.
// `p_stride`: floats from one of the tile's panels to the next (0: adjacent panels, k_len * 16).
// `ahead`: NP panels the tile also fetches into L2, a line per panel per k (the next pair, in this
// chunk or the next, while its first row tile runs: ~5% at 16 rows, ~2% at 256, where W otherwise comes from L3 or DRAM).
// Gated (NP = 2, whole panels): panel 0 is a gate panel, panel 1 its up panel, and the tile stores
// silu(gate) * up, 16 columns per row, instead of both products (panel_linear_silu_mul).
template <int MB, int NP, bool Gated = false, bool Packed = false>
RAYTP_AVX512 inline void tile512(const float* x, int64_t ldx, const float* w, int64_t k_len, Out out, int64_t p_stride = 0,
                                 const float* ahead = nullptr) {
  static_assert(!Gated || NP == 2, "a gated tile is one gate panel and its up panel");
  const int64_t panel_stride = p_stride != 0 ? p_stride : k_len * kPanel;
  __m512 acc[MB][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    if (ahead != nullptr) {  // the next NP panels, NP lines per k: all of them by the tile's end
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) _mm_prefetch(reinterpret_cast<const char*>(ahead + p * panel_stride + k * kPanel), _MM_HINT_T1);
    }
    __m512 wv[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      if constexpr (MB >= 4)
        _mm_prefetch(reinterpret_cast<const char*>(w + p * panel_stride + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
      wv[p] = _mm512_loadu_ps(w + p * panel_stride + k * kPanel);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(Packed ? x[k * MB + m] : x[m * ldx + k]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xb, wv[p], acc[m][p]);
    }
  }
  if constexpr (Gated) {
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out.ptr + m * out.ld, raytp::silu_mul16(acc[m][0], acc[m][1]));
    return;
  }
  if (out.n_left >= NP * kPanel) {  // every panel of the tile is whole: straight from the registers
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out.ptr + m * out.ld + p * kPanel, acc[m][p]);
    return;
  }
  alignas(64) float res[MB][NP][kPanel];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_store_ps(res[m][p], acc[m][p]);
  for (int m = 0; m < MB; ++m)
    for (int p = 0; p < NP; ++p) store_panel(out.ptr + m * out.ld + p * kPanel, out.n_left - p * kPanel, res[m][p]);
}

// `tiles` again, but carrying the target attribute so that tile512 can inline into it (GCC does not
// inline an AVX-512 function into one built for AVX2 only).
template <int MB, int NP>
RAYTP_AVX512 void tiles512(const float* x, int64_t ldx, const float* wp, int64_t k_len, int64_t g_begin,
                           int64_t g_end, float* op, int64_t ldo, int64_t n) {
  int64_t g = g_begin;
  for (; g + NP <= g_end; g += NP)
    tile512<MB, NP>(x, ldx, wp + g * k_len * kPanel, k_len, {op + g * kPanel, ldo, n - g * kPanel});
  if constexpr (NP > 2)  // a chunk of 6 panels in 4-wide tiles: its last two side by side
    for (; g + 2 <= g_end; g += 2) tile512<MB, 2>(x, ldx, wp + g * k_len * kPanel, k_len, {op + g * kPanel, ldo, n - g * kPanel});
  for (; g < g_end; ++g) tile512<MB, 1>(x, ldx, wp + g * k_len * kPanel, k_len, {op + g * kPanel, ldo, n - g * kPanel});
}

// 1-11 rows against panels [c, c_end): as many panels side by side as keep ~8+ chains within 32
// registers, and a divisor of the chunk (4, 6 or 12 panels) so none ends in a 1-panel tile.
RAYTP_AVX512 void few_rows512(const float* x, int64_t ldx, int64_t rows, const float* wp, int64_t k_len, int64_t c,
                              int64_t c_end, float* op, int64_t ldo, int64_t n) {
  switch (rows) {
    case 1: tiles512<1, 4>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 2: tiles512<2, 4>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 3: tiles512<3, 4>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 4: tiles512<4, 4>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 5: tiles512<5, 4>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 6: tiles512<6, 4>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 7: tiles512<7, 3>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 8: tiles512<8, 3>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 9: tiles512<9, 2>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 10: tiles512<10, 2>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    case 11: tiles512<11, 2>(x, ldx, wp, k_len, c, c_end, op, ldo, n); break;
    default: break;
  }
}

// A decode step or any call of under 12 rows: the thread's panels in chunks of 4 (6 for 7-8 rows).
RAYTP_AVX512 void few_rows_block512(const float* x, int64_t ldx, int64_t rows, const float* wp, int64_t k_len,
                                    int64_t g_begin, int64_t g_end, float* op, int64_t ldo, int64_t n) {
  const int64_t chunk = rows == 7 || rows == 8 ? kChunk3 : kChunk;
  for (int64_t c = g_begin; c < g_end; c += chunk)
    few_rows512(x, ldx, rows, wp, k_len, c, std::min(c + chunk, g_end), op, ldo, n);
}

// x's 12-row groups packed into strips [K][12] on first use, inside the one parallel region of the call:
// the first tile that needs group t claims it (compare-and-swap) and packs it; a tile that finds it
// claimed but not yet packed reads x in place instead (the same chain, the same bits), so no thread ever
// waits for another (a separate packing region first measured ~40% more process CPU than the old kernel
// on the loaded machine, 2 threads, 256 rows: its barrier spins whenever the other thread is descheduled).
struct Strips {
  const float* x;
  int64_t ldx, k_len;
  float* buf;  // [groups][K][12]
  int* state;  // per group: 0 unpacked, 1 being packed, 2 ready

  const float* get(int64_t t) const {
    float* d = buf + t * k_len * kBulkRows;
    const int s = __atomic_load_n(&state[t], __ATOMIC_ACQUIRE);
    if (s == 2) return d;
    int expected = 0;
    if (s != 0 || !__atomic_compare_exchange_n(&state[t], &expected, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return nullptr;
    const float* xr = x + t * kBulkRows * ldx;
    for (int64_t k = 0; k < k_len; ++k)
#pragma GCC unroll 12
      for (int64_t m = 0; m < kBulkRows; ++m) d[k * kBulkRows + m] = xr[m * ldx + k];
    __atomic_store_n(&state[t], 2, __ATOMIC_RELEASE);
    return d;
  }
};

// A 12-row tile of the bulk on group m / 12's strip, or on x in place while another thread packs it.
template <int NP, bool Gated = false>
RAYTP_AVX512 inline void bulk_tile512(const Strips& xs, int64_t m, const float* w, int64_t k_len, Out out, int64_t p_stride = 0,
                                      const float* ahead = nullptr) {
  if (const float* strip = xs.get(m / kBulkRows))
    tile512<kBulkRows, NP, Gated, true>(strip, 0, w, k_len, out, p_stride, ahead);
  else
    tile512<kBulkRows, NP, Gated>(xs.x + m * xs.ldx, xs.ldx, w, k_len, out, p_stride, ahead);
}

// One claimed chunk of panels [c, c_end) for every row of the call: per row block, 12-row tiles on x's
// strips (a pair of panels at a time, the pair's W re-read from L2 by each row tile), then the 1-11
// rows left over, on the chunk's panels while they are in L2.
RAYTP_AVX512 void chunk512(const Strips& xs, int64_t rows, const float* wp, int64_t k_len, int64_t c, int64_t c_end,
                           float* op, int64_t ldo, int64_t n) {
  const int64_t full = rows / kBulkRows * kBulkRows;
  for (int64_t m0 = 0; m0 < full; m0 += kRowBlock) {
    const int64_t m1 = std::min(m0 + kRowBlock, full);
    int64_t g = c;
    for (; g + 2 <= c_end; g += 2)
      for (int64_t m = m0; m < m1; m += kBulkRows)
        bulk_tile512<2>(xs, m, wp + g * k_len * kPanel, k_len, {op + m * ldo + g * kPanel, ldo, n - g * kPanel}, 0,
                        m == 0 && (g + 4) * kPanel < n + kPanel ? wp + (g + 2) * k_len * kPanel : nullptr);
    for (; g < c_end; ++g)
      for (int64_t m = m0; m < m1; m += kBulkRows)
        bulk_tile512<1>(xs, m, wp + g * k_len * kPanel, k_len, {op + m * ldo + g * kPanel, ldo, n - g * kPanel});
  }
  few_rows512(xs.x + full * xs.ldx, xs.ldx, rows - full, wp, k_len, c, c_end, op + full * ldo, ldo, n);
}

// panel_linear_silu_mul's chunk512: 12-row gated tiles on x's strips, one gate panel (and its up panel
// `half` panels further on) at a time, then the 1-11 rows left over with x read in place.
template <int MB>
RAYTP_AVX512 void gated_tiles512(const float* x, int64_t ldx, const float* wp, int64_t k_len, int64_t g_begin,
                                 int64_t g_end, float* op, int64_t ldo, int64_t half) {
  for (int64_t g = g_begin; g < g_end; ++g)
    tile512<MB, 2, true>(x, ldx, wp + g * k_len * kPanel, k_len, {op + g * kPanel, ldo, kPanel}, half * k_len * kPanel);
}

RAYTP_AVX512 void gated_chunk512(const Strips& xs, int64_t rows, const float* wp, int64_t k_len, int64_t c, int64_t c_end,
                                 float* op, int64_t ldo, int64_t half) {
  const int64_t full = rows / kBulkRows * kBulkRows;
  for (int64_t m0 = 0; m0 < full; m0 += kRowBlock)
    for (int64_t g = c; g < c_end; ++g)
      for (int64_t m = m0; m < std::min(m0 + kRowBlock, full); m += kBulkRows)
        bulk_tile512<2, true>(xs, m, wp + g * k_len * kPanel, k_len, {op + m * ldo + g * kPanel, ldo, kPanel}, half * k_len * kPanel,
                              m == 0 && g + 1 < half ? wp + (g + 1) * k_len * kPanel : nullptr);  // the next gate and up panels
  const float* xt = xs.x + full * xs.ldx;
  const int64_t ldx = xs.ldx;
  float* ot = op + full * ldo;
  switch (rows - full) {
    case 1: gated_tiles512<1>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 2: gated_tiles512<2>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 3: gated_tiles512<3>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 4: gated_tiles512<4>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 5: gated_tiles512<5>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 6: gated_tiles512<6>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 7: gated_tiles512<7>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 8: gated_tiles512<8>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 9: gated_tiles512<9>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 10: gated_tiles512<10>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    case 11: gated_tiles512<11>(xt, ldx, wp, k_len, c, c_end, ot, ldo, half); break;
    default: break;
  }
}

// The chunk size for `groups` panels: the first of `sizes` that gives every thread the same number of
// chunks, at least 3 each (balanced when no other process takes a core, fine-grained when one does).
int64_t pick_chunk(int64_t groups, std::initializer_list<int64_t> sizes) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  for (const int64_t c : sizes) {
    const int64_t n = (groups + c - 1) / c;
    if (n >= 3 * threads && n % threads == 0) return c;
  }
  return *(sizes.end() - 1);
}

// fn(c, c_end) for the chunks of [0, groups), each claimed by whichever thread is free next (one
// parallel region, an atomic counter). A static split in halves leaves one thread idle at the end of
// every call whenever another process (the serving tree's ingress, Ray's daemons) takes the other's
// core for a few ms; claiming lets the free thread take the rest. Which thread runs a chunk never
// changes what it computes: every element is still one chain, in one tile.
template <typename Fn>
void claim_chunks(int64_t groups, int64_t chunk, const Fn& fn) {
  const int64_t n = (groups + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(c * chunk, std::min(groups, c * chunk + chunk));
  });
}

// Calls of 12+ rows with AVX-512: the panels' chunks claimed one by one, chunk_fn(strips, rows, c, c_end,
// row0) running every row of the slab on its chunk. Rows go in slabs of at most kStripFloats of strips,
// so the calling thread's buffers (kept between calls: no page faults per call) stay bounded.
template <typename ChunkFn>
void bulk512(const float* x, int64_t ldx, int64_t rows, int64_t k_len, int64_t groups, int64_t chunk, const ChunkFn& chunk_fn) {
  static thread_local std::vector<float> buf;
  static thread_local std::vector<int> state;
  const int64_t slab = std::max<int64_t>(1, kStripFloats / (k_len * kBulkRows)) * kBulkRows;
  for (int64_t m0 = 0; m0 < rows; m0 += slab) {
    const int64_t mrows = std::min(slab, rows - m0), groups12 = mrows / kBulkRows;
    if (static_cast<int64_t>(buf.size()) < groups12 * k_len * kBulkRows) buf.resize(groups12 * k_len * kBulkRows);
    state.assign(groups12, 0);
    // The caller's buffers, named here: inside the region `buf` and `state` would be the worker's own.
    const Strips strips{x + m0 * ldx, ldx, k_len, buf.data(), state.data()};
    claim_chunks(groups, chunk, [&](int64_t c, int64_t c_end) { chunk_fn(strips, mrows, c, c_end, m0); });
  }
}

using raytp::use_avx512;
#else
// The same chains in plain C++ (one accumulator per element, k in order): builds without AVX2.
void block_scalar(const float* x, int64_t ldx, int64_t rows, const float* wp, int64_t k_len, int64_t g_begin,
                  int64_t g_end, float* op, int64_t ldo, int64_t n) {
  for (int64_t g = g_begin; g < g_end; ++g) {
    const float* w = wp + g * k_len * kPanel;
    const int64_t cols = std::min(kPanel, n - g * kPanel);
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t c = 0; c < cols; ++c) {
        float s = 0.f;
        for (int64_t k = 0; k < k_len; ++k) s = std::fma(x[m * ldx + k], w[k * kPanel + c], s);
        op[m * ldo + g * kPanel + c] = s;
      }
    }
  }
}
#endif

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel, "x [M, K] and panels [G, K, 16] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "panel_linear runs on float32");
  TORCH_CHECK(x.stride(1) == 1 && panels.is_contiguous(), "x needs a contiguous last dim, panels must be contiguous");
  const int64_t rows = x.size(0), k_len = x.size(1), groups = panels.size(0);
  TORCH_CHECK(panels.size(1) == k_len, "x has ", k_len, " features, the panels ", panels.size(1));
  TORCH_CHECK(out_features > (groups - 1) * kPanel && out_features <= groups * kPanel, "out_features does not match the panels");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
#if defined(__AVX2__) && defined(__FMA__)
  if (use_avx512() && rows >= kBulkRows) {
    bulk512(xp, ldx, rows, k_len, groups, pick_chunk(groups, {12, 6, 4, 2}),
            [&](const Strips& xs, int64_t mrows, int64_t c, int64_t c_end, int64_t m0) {
              chunk512(xs, mrows, wp, k_len, c, c_end, op + m0 * out_features, out_features, out_features);
            });
    return out;
  }
#endif
  // Under 12 rows (or without AVX-512) threads split the panels in halves, each streaming only its
  // share of W (a decode step's time); inside, row blocks keep x in L2.
  at::parallel_for(0, groups, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
      const int64_t mrows = std::min(kRowBlock, rows - m0);
      const float* xb = xp + m0 * ldx;
      float* ob = op + m0 * out_features;
#if defined(__AVX2__) && defined(__FMA__)
      if (use_avx512())
        few_rows_block512(xb, ldx, mrows, wp, k_len, begin, end, ob, out_features, out_features);
      else
        block_avx2(xb, ldx, mrows, wp, k_len, begin, end, ob, out_features, out_features);
#else
      block_scalar(xb, ldx, mrows, wp, k_len, begin, end, ob, out_features, out_features);
#endif
    }
  });
  return out;
}

// silu(x Wg^T) * (x Wu^T) for the fused gate/up projection of a gated MLP: panels [2 * d / 16, K, 16]
// hold Wg's panels, then Wu's (cpu_gemm.pack_panels of the stacked [2d, K] weight), d a multiple of
// 16. With AVX-512 each tile keeps a gate panel and its up panel side by side and stores only
// silu(gate) * up: the [M, 2d] product is never written (for a prefill chunk, tens of MB that the
// separate SiLU-and-mul read back). The same FMA chains and the same silu as panel_linear followed by
// silu_and_mul, so the same bits; without AVX-512 it is exactly that pair of steps.
at::Tensor panel_linear_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(out_features % kPanel == 0 && panels.dim() == 3 && panels.size(0) * kPanel == 2 * out_features,
              "panels must hold the gate and up halves, out_features (a multiple of 16) each");
#if defined(__AVX2__) && defined(__FMA__)
  if (!use_avx512()) {
    const at::Tensor both = panel_linear(x, panels, 2 * out_features);
    at::Tensor out = at::empty({x.size(0), out_features}, x.options());
    const float* bp = both.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t d = out_features;
    at::parallel_for(0, x.size(0), std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* gate = bp + r * 2 * d;
        for (int64_t i = 0; i < d; i += 8)
          _mm256_storeu_ps(op + r * d + i, raytp::silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(gate + d + i)));
      }
    });
    return out;
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "x [M, K] and panels [G, K, 16] in float32 expected");
  TORCH_CHECK(x.stride(1) == 1 && panels.is_contiguous() && panels.size(1) == x.size(1) && panels.size(2) == kPanel,
              "x needs a contiguous last dim matching the panels' K, panels must be contiguous");
  const int64_t rows = x.size(0), k_len = x.size(1), half = out_features / kPanel;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  if (rows >= kBulkRows) {
    bulk512(xp, ldx, rows, k_len, half, pick_chunk(half, {6, 4, 2, 1}),
            [&](const Strips& xs, int64_t mrows, int64_t c, int64_t c_end, int64_t m0) {
              gated_chunk512(xs, mrows, wp, k_len, c, c_end, op + m0 * out_features, out_features, half);
            });
  } else {
    at::parallel_for(0, half, kGrain / 2, [&](int64_t begin, int64_t end) {
      gated_chunk512({xp, ldx, k_len, nullptr, nullptr}, rows, wp, k_len, begin, end, op, out_features, half);
    });
  }
  return out;
#else
  TORCH_CHECK(false, "panel_linear_silu_mul needs the AVX2 build");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) {
  m.def("panel_linear(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.def("panel_linear_silu_mul(Tensor x, Tensor panels, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_silu_mul", &panel_linear_silu_mul);
}
