// sgl's CPU kernels for QuantizedWeight (backend/quant/weight.py): y = x @ W^T + b with W
// kept as integer codes and per-group float scale/zero (float32, or float16 where that is
// exact: `f16`; widened to float32 a feature or four at a time, group_floats, so the
// arithmetic is the same either way), activations float32.
//
//   y[m, n] = sum_g scale[n, g] * dot(code[n, g, :], x[m, g, :]) + zero[n, g] * sum(x[m, g, :])
//
// The per-group dot products run in float (codes converted in registers, AVX2 + FMA): the
// result equals dequantize-then-matmul up to float32 summation order. The row sums of x per
// group, and for 4-bit codes x permuted to the order the codes widen to, are computed once
// per call. Threads split the output features (OpenMP: the same
// libgomp torch loaded, so the same thread pool). Built at install time (setup.py) or at first
// use (cpu_kernel.py); cpu_build.py holds the sources, flags and key.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"
#define MAX_ROWS 8  // rows of x per pass over the weight (accumulators stay in registers)
#define N_BLOCK 16  // output features per scheduling unit
// One row of 4-bit codes reads four features' rows side by side (four_features4); the hardware
// prefetcher does not keep those four streams ahead, so the loop asks for the codes this many
// features further on (measured on the 2-core EPYC VM: 1.2-1.3x for a whole pass at 16, 1.1x at 4).
// The 2-8 row loops (row4, row8: verify rows, jumped tokens, small batches) do the same: a
// 2-row decode step of the default model 9.7 -> 6.4 ms against 4.9 for one row.
#define PREFETCH_ROWS 16

// Whether the 4-bit loops take their AVX-512 twins (row4_512, four_features4_512: the same
// bits as the AVX2 ones, fewer instructions per weight). Set at load where the CPU has it.
static int use_avx512 = 0;

static int avx512_present(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

#ifndef SGL_SOURCE_KEY
#define SGL_SOURCE_KEY ""
#endif
// The hash of the sources and flags this library was built from (cpu_build.source_key): a
// library built at install time whose key no longer matches its sources is not loaded.
const char* sgl_source_key(void) { return SGL_SOURCE_KEY; }

int sgl_cpu_ok(void) {
  __builtin_cpu_init();
  use_avx512 = avx512_present();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

// Turn the AVX-512 loops on (where the CPU has them) or off (tests compare both); returns
// whether they are on now.
int sgl_use_avx512(int on) {
  use_avx512 = on && avx512_present();
  return use_avx512;
}

// A group's 16 bytes of nibbles -> its 32 codes as four vectors of 8 int32 lanes in permute4's
// order: w0 lanes = low nibbles of bytes 0-3 | 8-11, w1 = of bytes 4-7 | 12-15, w2 and w3 the
// high nibbles of the same bytes. The bytes are broadcast to both 128-bit halves (a load, no
// shuffle) and one in-lane byte shuffle per pair zero-extends four bytes to each half's dwords:
// two shuffles per group where widening to int16 and unpacking took five (the shuffle unit
// was the one-row loop's bottleneck).
AVX2 INLINE void widen4(const uint8_t* p, __m256i* w0, __m256i* w1, __m256i* w2, __m256i* w3) {
  const __m256i lo4 = _mm256_set1_epi32(0x0F);
  const __m256i sel02 = _mm256_setr_epi8(
      0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
      8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1);
  const __m256i sel13 = _mm256_setr_epi8(
      4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1,
      12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
  __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  __m256i a = _mm256_shuffle_epi8(b, sel02), c = _mm256_shuffle_epi8(b, sel13);
  *w0 = _mm256_and_si256(a, lo4), *w2 = _mm256_srli_epi32(a, 4);
  *w1 = _mm256_and_si256(c, lo4), *w3 = _mm256_srli_epi32(c, 4);
}

// One output feature n, rows [m0, m0 + mc) of x. bits 4: 32-wide groups of nibbles, read
// against `xp`, x with each group's features permuted into the order the codes widen to
// (`permute4`): one lane-crossing widen per group instead of four. The zero term is added
// by the caller (`zero_terms`). bits 8: int8 codes, group_size a multiple of 8.
AVX2 INLINE void row4(const float* xp, int64_t K, int64_t m0, const int mc,
                      const uint8_t* codes, const float* s, int64_t G, float* out) {
  __m256 acc[MAX_ROWS], acc_odd[MAX_ROWS];  // two chains: groups alternate between them
  for (int m = 0; m < mc; m++) { acc[m] = _mm256_setzero_ps(); acc_odd[m] = _mm256_setzero_ps(); }
  for (int64_t g = 0; g < G; g++) {
    __m256i i0, i1, i2, i3;  // (low nibbles are codes 0-15, high nibbles codes 16-31)
    _mm_prefetch((const char*)codes + PREFETCH_ROWS * (K / 2) + g * 16, _MM_HINT_T0);
    widen4(codes + g * 16, &i0, &i1, &i2, &i3);
    __m256 w0 = _mm256_cvtepi32_ps(i0), w1 = _mm256_cvtepi32_ps(i1);
    __m256 w2 = _mm256_cvtepi32_ps(i2), w3 = _mm256_cvtepi32_ps(i3);
    __m256 sg = _mm256_broadcast_ss(s + g);
    for (int m = 0; m < mc; m++) {
      const float* xg = xp + (m0 + m) * K + g * 32;
      __m256 d = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
      __m256 d2 = _mm256_mul_ps(w1, _mm256_loadu_ps(xg + 8));
      d = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), d);
      d2 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), d2);
      if (g & 1) acc_odd[m] = _mm256_fmadd_ps(_mm256_add_ps(d, d2), sg, acc_odd[m]);
      else acc[m] = _mm256_fmadd_ps(_mm256_add_ps(d, d2), sg, acc[m]);
    }
  }
  for (int m = 0; m < mc; m++) out[m] = hsum8(_mm256_add_ps(acc[m], acc_odd[m]));
}

// widen4 on 512-bit vectors: the same codes as two vectors of 16 int32 lanes, `lo` = w0 | w1
// (lanes 0-7 | 8-15) and `hi` = w2 | w3. One shuffle per group: each 128-bit lane of the
// broadcast bytes zero-extends its own four bytes (0-3, 8-11, 4-7, 12-15).
// (pshufb indices: byte k into the low byte of a dword; 0xFF zeroes the other three.)
#define Z4(a) 0xFFFFFF00u | (a), 0xFFFFFF00u | (a + 1), 0xFFFFFF00u | (a + 2), 0xFFFFFF00u | (a + 3)
static const uint32_t WIDEN4_512[16] = {Z4(0), Z4(8), Z4(4), Z4(12)};

AVX512 INLINE void widen4_512(const uint8_t* p, __m512i* lo, __m512i* hi) {
  const __m512i sel = _mm512_loadu_si512(WIDEN4_512);
  __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p));
  __m512i a = _mm512_shuffle_epi8(b, sel);
  *lo = _mm512_and_si512(a, _mm512_set1_epi32(0x0F));
  *hi = _mm512_srli_epi32(a, 4);
}

// A group's `d + d2` of row4 for one row, from widen4_512's codes converted: lanes 0-7 of the
// product are d's (w0 * x0, then + w2 * x2), lanes 8-15 d2's, each lane rounded as there.
AVX512 INLINE __m256 group_dot512(__m512 lo, __m512 hi, const float* xg) {
  __m512 d = _mm512_mul_ps(lo, _mm512_loadu_ps(xg));
  d = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), d);
  return _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
}

// row4 with 512-bit vectors: the same bits.
AVX512 INLINE void row4_512(const float* xp, int64_t K, int64_t m0, const int mc,
                            const uint8_t* codes, const float* s, int64_t G, float* out) {
  __m256 acc[MAX_ROWS], acc_odd[MAX_ROWS];
  for (int m = 0; m < mc; m++) { acc[m] = _mm256_setzero_ps(); acc_odd[m] = _mm256_setzero_ps(); }
  for (int64_t g = 0; g < G; g++) {
    __m512i ilo, ihi;
    _mm_prefetch((const char*)codes + PREFETCH_ROWS * (K / 2) + g * 16, _MM_HINT_T0);
    widen4_512(codes + g * 16, &ilo, &ihi);
    __m512 lo = _mm512_cvtepi32_ps(ilo), hi = _mm512_cvtepi32_ps(ihi);
    __m256 sg = _mm256_broadcast_ss(s + g);
    for (int m = 0; m < mc; m++) {
      __m256 d = group_dot512(lo, hi, xp + (m0 + m) * K + g * 32);
      if (g & 1) acc_odd[m] = _mm256_fmadd_ps(d, sg, acc_odd[m]);
      else acc[m] = _mm256_fmadd_ps(d, sg, acc[m]);
    }
  }
  for (int m = 0; m < mc; m++) out[m] = hsum8(_mm256_add_ps(acc[m], acc_odd[m]));
}

// The order in which row4 widens a group's 32 codes (see there).
static const int PERMUTE4[32] = {0,  1,  2,  3,  8,  9,  10, 11, 4,  5,  6,  7,  12, 13, 14, 15,
                                 16, 17, 18, 19, 24, 25, 26, 27, 20, 21, 22, 23, 28, 29, 30, 31};

static void permute4(const float* x, int64_t n, float* xp) {
  for (int64_t i = 0; i < n; i += 32)
    for (int j = 0; j < 32; j++) xp[i + j] = x[i + PERMUTE4[j]];
}

// sum over groups of zero[n, g] * (sum of x[m]'s group g), for rows [m0, m0 + mc).
AVX2 INLINE void zero_terms(const void* z, int f16, const float* xsum, int64_t G, int64_t m0,
                            int mc, float* out) {
  for (int m = 0; m < mc; m++) {
    out[m] += zero_term(z, f16, xsum + (m0 + m) * G, G);
  }
}

AVX2 INLINE void row8(const float* x, int64_t K, int64_t m0, const int mc,
                      const int8_t* codes, const float* s, const int gs, int64_t G, float* out) {
  __m256 acc[MAX_ROWS];
  for (int m = 0; m < mc; m++) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m256 sg = _mm256_set1_ps(s[g]);
    _mm_prefetch((const char*)codes + PREFETCH_ROWS * K + g * gs, _MM_HINT_T0);
    for (int m = 0; m < mc; m++) {
      const float* xg = x + (m0 + m) * K + g * gs;
      __m256 d = _mm256_setzero_ps();
      for (int v = 0; v < gs; v += 8) {
        __m128i q = _mm_loadl_epi64((const __m128i*)(codes + g * gs + v));
        d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                            _mm256_loadu_ps(xg + v), d);
      }
      acc[m] = _mm256_fmadd_ps(d, sg, acc[m]);
    }
  }
  for (int m = 0; m < mc; m++) out[m] = hsum8(acc[m]);
}

// Constant row counts let the compiler keep the accumulators in registers.
#define DISPATCH(CALL) switch (mc) { \
  case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
  case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; \
  case 7: CALL(7); break; default: CALL(8); break; }

// feature's 4-bit rows on the AVX-512 twin, apart from `feature` itself: a function compiled
// for AVX-512 may use its registers (ymm16-31, EVEX forms) in any code inlined into it, which
// an AVX2-only CPU cannot run, so only the *_512 functions are compiled for AVX-512.
#define CALL4_512(R) row4_512(xp, K, m0, R, c, s, G, out)
AVX512 static void rows4_512(const float* xp, int64_t K, int64_t m0, const int mc,
                             const uint8_t* c, const float* s, int64_t G, float* out) {
  DISPATCH(CALL4_512)
}

// Output feature n, every row; s: its G scales (float32), z: its G zeros (float16 if f16).
AVX2 static void feature(int bits, int gs, const float* x, const float* xp, int64_t M, int64_t K,
                         const void* codes, const float* s, const void* z, int f16, int64_t n,
                         int64_t N, const float* bias, const float* xsum, int64_t G, float* y) {
  float out[MAX_ROWS];
  for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
    int mc = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
    if (bits == 4) {
      const uint8_t* c = (const uint8_t*)codes + n * (K / 2);
#define CALL4(R) row4(xp, K, m0, R, c, s, G, out)
      if (use_avx512) {
        rows4_512(xp, K, m0, mc, c, s, G, out);
      } else {
        DISPATCH(CALL4)
      }
    } else if (gs == 32) {  // constant group sizes: the inner loop unrolls
      const int8_t* c = (const int8_t*)codes + n * K;
#define CALL8_32(R) row8(x, K, m0, R, c, s, 32, G, out)
      DISPATCH(CALL8_32)
    } else {
      const int8_t* c = (const int8_t*)codes + n * K;
#define CALL8_16(R) row8(x, K, m0, R, c, s, 16, G, out)
      DISPATCH(CALL8_16)
    }
    zero_terms(z, f16, xsum, G, m0, mc, out);
    float b = bias ? bias[n] : 0.0f;
    for (int m = 0; m < mc; m++) y[(m0 + m) * N + n] = out[m] + b;
  }
}

// One row of x (a single stream's decode), bits 4: four output features [n, n + 4) per pass
// over x's groups, so each group of x is loaded once for four features and the four
// accumulator chains overlap (the per-feature row4 spends a third of its time on latencies
// and x loads at K = 576). Writes y[n .. n + 3] without the zero term.
AVX2 static void four_features4(const float* xp, int64_t K, const uint8_t* codes,
                                const float* s, int64_t G, float* y) {
  const int64_t row = K / 2;
  __m256 acc[4];
  for (int f = 0; f < 4; f++) acc[f] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    const float* xg = xp + g * 32;
    __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
    __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
    for (int f = 0; f < 4; f++) {
      __m256i i0, i1, i2, i3;
      _mm_prefetch((const char*)codes + (PREFETCH_ROWS + f) * row + g * 16, _MM_HINT_T0);
      widen4(codes + f * row + g * 16, &i0, &i1, &i2, &i3);
      __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(i0), x0);
      __m256 d2 = _mm256_mul_ps(_mm256_cvtepi32_ps(i1), x1);
      d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i2), x2, d);
      d2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i3), x3, d2);
      acc[f] = _mm256_fmadd_ps(_mm256_add_ps(d, d2), _mm256_broadcast_ss(s + f * G + g), acc[f]);
    }
  }
  for (int f = 0; f < 4; f++) y[f] = hsum8(acc[f]);
}

// four_features4 with 512-bit vectors: the same bits.
AVX512 static void four_features4_512(const float* xp, int64_t K, const uint8_t* codes,
                                      const float* s, int64_t G, float* y) {
  const int64_t row = K / 2;
  __m256 acc[4];
  for (int f = 0; f < 4; f++) acc[f] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    for (int f = 0; f < 4; f++) {
      __m512i ilo, ihi;
      _mm_prefetch((const char*)codes + (PREFETCH_ROWS + f) * row + g * 16, _MM_HINT_T0);
      widen4_512(codes + f * row + g * 16, &ilo, &ihi);
      __m256 d = group_dot512(_mm512_cvtepi32_ps(ilo), _mm512_cvtepi32_ps(ihi), xp + g * 32);
      acc[f] = _mm256_fmadd_ps(d, _mm256_broadcast_ss(s + f * G + g), acc[f]);
    }
  }
  for (int f = 0; f < 4; f++) y[f] = hsum8(acc[f]);
}

// Features [n, n + c), c <= 4, for one row of 4-bit codes: four together (c = 4), else one by
// one. s: their [c, G] scales (float32), z: their zeros (float16 if f16).
AVX2 static void single_row4(const float* xp, int64_t K, const void* codes, const float* s,
                             const void* z, int f16, int64_t n, int64_t c, const float* bias,
                             const float* xsum, int64_t G, float* y) {
  const uint8_t* first = (const uint8_t*)codes + n * (K / 2);
  if (c == 4 && use_avx512)
    four_features4_512(xp, K, first, s, G, y + n);
  else if (c == 4)
    four_features4(xp, K, first, s, G, y + n);
  else
    for (int64_t f = 0; f < c; f++) row4(xp, K, 0, 1, first + f * (K / 2), s + f * G, G, y + n + f);
  for (int64_t f = 0; f < c; f++) {
    zero_terms((const char*)z + f * G * group_bytes(f16), f16, xsum, G, 0, 1, y + n + f);
    if (bias) y[n + f] += bias[n + f];
  }
}

// One row of x, 8-bit codes in groups of GS: four output features [n, n + 4) side by side,
// each with row8's arithmetic for one row (so the same bits). One feature alone is a chain of
// dependent FMAs (the group's dot, then the accumulator: latency-bound, ~14 GB/s on the tied
// head at two threads); four interleaved chains keep the FMA units busy. Writes y[0 .. 3]
// without the zero term.
AVX2 INLINE void four_features8(const float* x, int64_t K, const int8_t* codes, const float* s,
                                const int GS, int64_t G, float* y) {
  __m256 acc[4];
  for (int f = 0; f < 4; f++) acc[f] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m256 d[4];
    for (int f = 0; f < 4; f++) {
      d[f] = _mm256_setzero_ps();
      _mm_prefetch((const char*)codes + (8 + f) * K + g * GS, _MM_HINT_T0);
    }
    for (int v = 0; v < GS; v += 8) {
      __m256 xv = _mm256_loadu_ps(x + g * GS + v);
      for (int f = 0; f < 4; f++) {
        __m128i q = _mm_loadl_epi64((const __m128i*)(codes + f * K + g * GS + v));
        d[f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), xv, d[f]);
      }
    }
    for (int f = 0; f < 4; f++) acc[f] = _mm256_fmadd_ps(d[f], _mm256_set1_ps(s[f * G + g]), acc[f]);
  }
  for (int f = 0; f < 4; f++) y[f] = hsum8(acc[f]);
}

// Features [n, n + 4) of one row of 8-bit codes, complete: as `feature` computes each (its
// zero term, then its bias or +0.0f), four at a time.
AVX2 static void single_row8(int gs, const float* x, int64_t K, const void* codes,
                             const float* s, const void* z, int f16, int64_t n,
                             const float* bias, const float* xsum, int64_t G, float* y) {
  float out[4];
  const int8_t* first = (const int8_t*)codes + n * K;
  if (gs == 32)  // (constant group sizes: the inner loop unrolls)
    four_features8(x, K, first, s, 32, G, out);
  else
    four_features8(x, K, first, s, 16, G, out);
  for (int f = 0; f < 4; f++) {
    zero_terms((const char*)z + f * G * group_bytes(f16), f16, xsum, G, 0, 1, out + f);
    y[n + f] = out[f] + (bias ? bias[n + f] : 0.0f);
  }
}

// The serial part of a product: x's per-group sums xsum [M * K / gs], and for bits 4 x
// permuted to the codes' widening order, xp [M * K].
AVX2 void sgl_qlinear_prepare(int bits, int gs, const float* x, int64_t M, int64_t K,
                              float* xsum, float* xp) {
  int64_t G = K / gs;
  if (bits == 4) permute4(x, M * K, xp);
  for (int64_t i = 0; i < M * G; i++) {
    float t = 0.0f;
    for (int j = 0; j < gs; j++) t += x[i * gs + j];
    xsum[i] = t;
  }
}

int64_t sgl_qlinear_blocks(int64_t N) { return (N + N_BLOCK - 1) / N_BLOCK; }

// Output features [blk * N_BLOCK, ...) of every row: the unit threads share out, four
// features at a time (their float16 scales widened together, group_floats). How a
// block groups its features (one row of 4-bit codes: fours, then one by one) depends only on
// the block, so any split of the blocks over threads gives the same bits.
AVX2 void sgl_qlinear_block(int bits, int gs, const float* x, const float* xp, int64_t M,
                            int64_t K, const void* codes, const void* scale, const void* zero,
                            int f16, int64_t N, const float* bias, const float* xsum, float* y,
                            int64_t blk) {
  int64_t G = K / gs, gb = group_bytes(f16);
  int64_t end = (blk + 1) * N_BLOCK < N ? (blk + 1) * N_BLOCK : N;
  float sbuf[f16 ? 4 * G : 1];
  for (int64_t n = blk * N_BLOCK; n < end; n += 4) {
    int64_t c = end - n < 4 ? end - n : 4;
    const float* s = group_floats((const char*)scale + n * G * gb, f16, c * G, sbuf);
    const char* z = (const char*)zero + n * G * gb;
    if (bits == 4 && M == 1) {
      single_row4(xp, K, codes, s, z, f16, n, c, bias, xsum, G, y);
      continue;
    }
    if (bits == 8 && M == 1 && c == 4) {
      single_row8(gs, x, K, codes, s, z, f16, n, bias, xsum, G, y);
      continue;
    }
    for (int64_t f = 0; f < c; f++)
      feature(bits, gs, x, xp, M, K, codes, s + f * G, z + f * G * gb, f16, n + f, N, bias,
              xsum, G, y);
  }
}

// x [M, K], y [M, N] float32 row-major; codes/scale/zero as in weight.py (scale and zero
// float16 when f16, else float32); bias may be NULL. Scratch from the caller: xsum
// [M * K / gs], and for bits 4 xp [M * K] (NULL for bits 8).
AVX2 void sgl_qlinear_into(int bits, int gs, const float* x, int64_t M, int64_t K,
                           const void* codes, const void* scale, const void* zero, int f16,
                           int64_t N, const float* bias, float* y, int threads, float* xsum,
                           float* xp) {
  sgl_qlinear_prepare(bits, gs, x, M, K, xsum, xp);
  int64_t blocks = sgl_qlinear_blocks(N);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t blk = 0; blk < blocks; blk++)
    sgl_qlinear_block(bits, gs, x, xp, M, K, codes, scale, zero, f16, N, bias, xsum, y, blk);
}

AVX2 void sgl_qlinear(int bits, int gs, const float* x, int64_t M, int64_t K, const void* codes,
                      const void* scale, const void* zero, int f16, int64_t N,
                      const float* bias, float* y, int threads) {
  int64_t G = K / gs;
  float* xsum = (float*)malloc(sizeof(float) * (size_t)(M * G > 0 ? M * G : 1));
  float* xp = bits == 4 ? (float*)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1)) : NULL;
  sgl_qlinear_into(bits, gs, x, M, K, codes, scale, zero, f16, N, bias, y, threads, xsum, xp);
  free(xsum);
  free(xp);
}

// out [N, K] float32 = the dequantized weight (the prefill path: then one float matmul).
AVX2 void sgl_qdequant(int bits, int gs, const void* codes, const void* scale, const void* zero,
                       int f16, int64_t N, int64_t K, float* out, int threads) {
  int64_t G = K / gs;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) {
    float* o = out + n * K;
    for (int64_t g = 0; g < G; g++) {
      float s = group_float(scale, f16, n * G + g), z = group_float(zero, f16, n * G + g);
      if (bits == 4) {
        const uint8_t* c = (const uint8_t*)codes + n * (K / 2) + g * 16;
        for (int i = 0; i < 16; i++) {
          o[g * 32 + i] = s * (float)(c[i] & 0xF) + z;
          o[g * 32 + 16 + i] = s * (float)(c[i] >> 4) + z;
        }
      } else {
        const int8_t* c = (const int8_t*)codes + n * K + g * gs;
        for (int i = 0; i < gs; i++) o[g * gs + i] = s * (float)c[i] + z;
      }
    }
  }
}
