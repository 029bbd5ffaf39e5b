// sgl's CPU kernels for QuantizedWeight (backend/quant/weight.py): y = x @ W^T + b with W
// kept as integer codes and per-group float scale/zero (float32, or float16 where that is
// exact: `f16`; widened to float32 four features at a time, group_floats, so the arithmetic
// is the same either way), activations float32.
//
//   y[m, n] = sum_g scale[n, g] * dot(code[n, g, :], x[m, g, :]) + zero[n, g] * sum(x[m, g, :])
//
// The per-group dot products run in float (codes converted in registers, AVX2 + FMA, or
// AVX-512 for 4-bit codes where the CPU has it): the result equals dequantize-then-matmul up
// to float32 summation order. Each output's order is fixed (tile4_512 and its twin, tile8), so
// it has the same bits at one row as in a batch of 32 (verify rows and jumped tokens equal plain
// decoding). A tile of four features converts a group's codes once for up to five rows, so an
// extra row costs its multiply-adds, not the conversions again. The row sums of x per group,
// and for 4-bit codes x permuted to the order the codes widen to, are computed once per call.
// Threads split the output features (OpenMP: the same libgomp torch loaded, so the same thread
// pool). Built at install time (setup.py) or at first use (cpu_kernel.py); cpu_build.py holds
// the sources, flags and key.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"
#define N_BLOCK 16  // output features per scheduling unit
#define TILE_FEATURES 4  // output features per tile (their codes converted together)
#define TILE_ROWS 5      // rows per tile (AVX-512: 4 x 5 accumulators of 16 lanes)
// A tile reads four features' code rows side by side; the hardware prefetcher does not keep
// those streams ahead, so the loop asks for the codes this many features further on (measured
// on the 2-core EPYC VM: 1.2-1.3x for a whole one-row pass at 16, 1.1x at 4).
#define PREFETCH_ROWS 16
// Loops over a tile's features, rows and vectors run unrolled: their registers are arrays.
#define UNROLL _Pragma("GCC unroll 8")

// Whether the 4-bit tiles run on 512-bit vectors (tile4_512: the same bits as tile4_256,
// fewer instructions per weight). Set at load where the CPU has AVX-512.
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

// The order in which widen4 and widen4_512 give a group's 32 codes.
static const int PERMUTE4[32] = {0,  1,  2,  3,  8,  9,  10, 11, 4,  5,  6,  7,  12, 13, 14, 15,
                                 16, 17, 18, 19, 24, 25, 26, 27, 20, 21, 22, 23, 28, 29, 30, 31};

static void permute4(const float* x, int64_t n, float* xp) {
  for (int64_t i = 0; i < n; i += 32)
    for (int j = 0; j < 32; j++) xp[i + j] = x[i + PERMUTE4[j]];
}

// sum over groups of zero[n, g] * (sum of x[m]'s group g), for rows [m0, m0 + R): the zero
// terms of a tile's feature (out: its R results, with stride F).
AVX2 INLINE void zero_terms(const void* z, int f16, const float* xsum, int64_t G, int64_t m0,
                            int R, int F, float* out) {
  for (int r = 0; r < R; r++) out[r * F] += zero_term(z, f16, xsum + (m0 + r) * G, G);
}

// 4-bit codes, AVX-512: features f < F (codes c + f * rb, scales s [F, G] float32) by rows
// r < R of xp (from row m0). Each (feature, row) is one 16-lane accumulator: per group, the
// 32 products of codes and x folded to 16 lanes (d = lo * x + hi * x'), then acc += d * scale;
// at the end the lanes summed (hsum8 of the halves' sum). out[r * F + f], without zero terms.
// A group's codes are converted once for the tile's R rows. F and R are constants at each call
// (tiles4_512's switch), so the accumulators stay in registers; the codes of the features
// PREFETCH_ROWS further on are requested as we go.
AVX512 INLINE void tile4_512(const uint8_t* c, int64_t rb, const float* s, int64_t G,
                             const float* xp, int64_t K, int64_t m0, const int F, const int R,
                             float* out) {
  __m512 acc[TILE_FEATURES][TILE_ROWS];
  UNROLL for (int f = 0; f < F; f++)
    UNROLL for (int r = 0; r < R; r++) acc[f][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m512 lo[TILE_FEATURES], hi[TILE_FEATURES];
    UNROLL for (int f = 0; f < F; f++) {
      __m512i ilo, ihi;
      _mm_prefetch((const char*)c + (PREFETCH_ROWS + f) * rb + g * 16, _MM_HINT_T0);
      widen4_512(c + f * rb + g * 16, &ilo, &ihi);
      lo[f] = _mm512_cvtepi32_ps(ilo), hi[f] = _mm512_cvtepi32_ps(ihi);
    }
    UNROLL for (int r = 0; r < R; r++) {
      const float* xg = xp + (m0 + r) * K + g * 32;
      __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
      UNROLL for (int f = 0; f < F; f++) {
        __m512 d = _mm512_fmadd_ps(hi[f], x1, _mm512_mul_ps(lo[f], x0));
        acc[f][r] = _mm512_fmadd_ps(d, _mm512_set1_ps(s[f * G + g]), acc[f][r]);
      }
    }
  }
  UNROLL for (int r = 0; r < R; r++)
    UNROLL for (int f = 0; f < F; f++)
      out[r * F + f] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[f][r]),
                                           _mm512_extractf32x8_ps(acc[f][r], 1)));
}

// tile4_512 on 8-lane vectors (CPUs without AVX-512): the same bits, each 16-lane vector a
// pair (widen4's w0 | w1 and w2 | w3 are widen4_512's lo and hi). A feature's codes are
// converted when its turn comes (16 registers: F * R <= 4).
AVX2 INLINE void tile4_256(const uint8_t* c, int64_t rb, const float* s, int64_t G,
                           const float* xp, int64_t K, int64_t m0, const int F, const int R,
                           float* out) {
  __m256 acc[TILE_FEATURES][TILE_ROWS][2];
  UNROLL for (int f = 0; f < F; f++)
    UNROLL for (int r = 0; r < R; r++) acc[f][r][0] = acc[f][r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    UNROLL for (int f = 0; f < F; f++) {
      __m256i i0, i1, i2, i3;
      _mm_prefetch((const char*)c + (PREFETCH_ROWS + f) * rb + g * 16, _MM_HINT_T0);
      widen4(c + f * rb + g * 16, &i0, &i1, &i2, &i3);
      __m256 w0 = _mm256_cvtepi32_ps(i0), w1 = _mm256_cvtepi32_ps(i1);
      __m256 w2 = _mm256_cvtepi32_ps(i2), w3 = _mm256_cvtepi32_ps(i3);
      __m256 sg = _mm256_broadcast_ss(s + f * G + g);
      UNROLL for (int r = 0; r < R; r++) {
        const float* xg = xp + (m0 + r) * K + g * 32;
        __m256 d0 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), _mm256_mul_ps(w0, _mm256_loadu_ps(xg)));
        __m256 d1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24),
                                    _mm256_mul_ps(w1, _mm256_loadu_ps(xg + 8)));
        acc[f][r][0] = _mm256_fmadd_ps(d0, sg, acc[f][r][0]);
        acc[f][r][1] = _mm256_fmadd_ps(d1, sg, acc[f][r][1]);
      }
    }
  }
  UNROLL for (int r = 0; r < R; r++)
    UNROLL for (int f = 0; f < F; f++) out[r * F + f] = hsum8(_mm256_add_ps(acc[f][r][0], acc[f][r][1]));
}

// 8-bit codes in groups of GS (16 or 32): each (feature, row) one 8-lane accumulator; per
// group d = sum over its vectors of code * x (a chain of FMAs from zero), then acc += d * scale.
// The codes of a feature are converted once for the tile's R rows (F * R <= 5; one row: four
// features side by side, whose chains overlap). Its rows of codes are twice a 4-bit row's
// bytes, so the prefetch looks half as many features ahead.
AVX2 INLINE void tile8(const int8_t* c, int64_t rb, const float* s, const int GS, int64_t G,
                       const float* x, int64_t K, int64_t m0, const int F, const int R,
                       float* out) {
  __m256 acc[TILE_FEATURES][TILE_ROWS];
  UNROLL for (int f = 0; f < F; f++)
    UNROLL for (int r = 0; r < R; r++) acc[f][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m256 d[TILE_FEATURES][TILE_ROWS];
    UNROLL for (int f = 0; f < F; f++) {
      _mm_prefetch((const char*)c + (PREFETCH_ROWS / 2 + f) * rb + g * GS, _MM_HINT_T0);
      UNROLL for (int r = 0; r < R; r++) d[f][r] = _mm256_setzero_ps();
    }
    UNROLL for (int v = 0; v < GS; v += 8) {
      __m256 xv[TILE_ROWS];
      UNROLL for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + (m0 + r) * K + g * GS + v);
      UNROLL for (int f = 0; f < F; f++) {
        __m128i q = _mm_loadl_epi64((const __m128i*)(c + f * rb + g * GS + v));
        __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        UNROLL for (int r = 0; r < R; r++) d[f][r] = _mm256_fmadd_ps(w, xv[r], d[f][r]);
      }
    }
    UNROLL for (int f = 0; f < F; f++) {
      __m256 sg = _mm256_set1_ps(s[f * G + g]);
      UNROLL for (int r = 0; r < R; r++) acc[f][r] = _mm256_fmadd_ps(d[f][r], sg, acc[f][r]);
    }
  }
  UNROLL for (int r = 0; r < R; r++)
    UNROLL for (int f = 0; f < F; f++) out[r * F + f] = hsum8(acc[f][r]);
}

// The tile shapes, as constants: four features of one row, or (several rows) AVX-512's four
// features by up to five rows (a 1 + 4-draft verify step in one tile: 0.90x the time of a
// four-row tile plus a one-row tile), AVX2's one feature by up to five (8-bit) or four rows.
#define ROW_CASES(CALL, F_)                                           \
  switch (R) {                                                        \
    case 1: CALL(F_, 1); break; case 2: CALL(F_, 2); break;           \
    case 3: CALL(F_, 3); break; case 4: CALL(F_, 4); break;           \
    default: CALL(F_, 5); break; }
#define FEATURE_CASES(CALL)                                           \
  switch (F) {                                                        \
    case 1: CALL(1, 1); break; case 2: CALL(2, 1); break;             \
    case 3: CALL(3, 1); break; default: CALL(4, 1); break; }
// Features one at a time, each by R rows, into out[r * F + f].
#define BY_FEATURE(CALL)                                              \
  for (int f = 0; f < F; f++) {                                       \
    float part[TILE_ROWS];                                            \
    const float* sf = s + f * G;                                      \
    const int64_t cf = f * rb;                                        \
    ROW_CASES(CALL, 1)                                                \
    for (int r = 0; r < R; r++) out[r * F + f] = part[r];             \
  }

#define T512(F_, R_) tile4_512(c, rb, s, G, xp, K, m0, F_, R_, out)
AVX512 static void tiles4_512(const uint8_t* c, int64_t rb, const float* s, int64_t G,
                              const float* xp, int64_t K, int64_t m0, int F, int R, float* out) {
  switch (F) {
    case 1: ROW_CASES(T512, 1) break;
    case 2: ROW_CASES(T512, 2) break;
    case 3: ROW_CASES(T512, 3) break;
    default: ROW_CASES(T512, 4) break;
  }
}

#define T256(F_, R_) tile4_256(c, rb, s, G, xp, K, m0, F_, R_, out)
#define T256_PART(F_, R_) tile4_256(c + cf, rb, sf, G, xp, K, m0, F_, R_, part)
AVX2 static void tiles4_256(const uint8_t* c, int64_t rb, const float* s, int64_t G,
                            const float* xp, int64_t K, int64_t m0, int F, int R, float* out) {
  if (R == 1) {
    FEATURE_CASES(T256)
  } else {
    BY_FEATURE(T256_PART)
  }
}

#define T8(F_, R_) tile8(c, rb, s, GS, G, x, K, m0, F_, R_, out)
#define T8_PART(F_, R_) tile8(c + cf, rb, sf, GS, G, x, K, m0, F_, R_, part)
AVX2 INLINE void tiles8(const int8_t* c, int64_t rb, const float* s, const int GS, int64_t G,
                        const float* x, int64_t K, int64_t m0, int F, int R, float* out) {
  if (R == 1) {
    FEATURE_CASES(T8)
  } else {
    BY_FEATURE(T8_PART)
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

// Output features [blk * N_BLOCK, ...) of every row: the unit threads share out, in tiles of
// four features (their float16 scales widened together, group_floats) by up to five rows.
// An output's bits do not depend on the tile that computed it, so any split of the blocks over
// threads, and any number of rows, gives the same bits (verify rows and jumped tokens equal
// plain decoding).
AVX2 void sgl_qlinear_block(int bits, int gs, const float* x, const float* xp, int64_t M,
                            int64_t K, const void* codes, const void* scale, const void* zero,
                            int f16, int64_t N, const float* bias, const float* xsum, float* y,
                            int64_t blk) {
  int64_t G = K / gs, gb = group_bytes(f16);
  int64_t rb = bits == 4 ? K / 2 : K;  // code bytes per feature
  int64_t end = (blk + 1) * N_BLOCK < N ? (blk + 1) * N_BLOCK : N;
  float sbuf[f16 ? TILE_FEATURES * G : 1];
  float out[TILE_FEATURES * TILE_ROWS];
  // (4-bit codes on AVX2: tiles of four rows; five spill tile4_256's 16 registers, 1.06-1.10x
  // the time at 8-16 rows)
  const int rows = bits == 4 && !use_avx512 ? 4 : TILE_ROWS;
  for (int64_t n = blk * N_BLOCK; n < end; n += TILE_FEATURES) {
    int F = (int)(end - n < TILE_FEATURES ? end - n : TILE_FEATURES);
    const float* s = group_floats((const char*)scale + n * G * gb, f16, F * G, sbuf);
    const char* z = (const char*)zero + n * G * gb;
    const uint8_t* c = (const uint8_t*)codes + n * rb;
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      int R = (int)(M - m0 < rows ? M - m0 : rows);
      if (bits == 4 && use_avx512)
        tiles4_512(c, rb, s, G, xp, K, m0, F, R, out);
      else if (bits == 4)
        tiles4_256(c, rb, s, G, xp, K, m0, F, R, out);
      else if (gs == 32)  // (constant group sizes: the inner loop unrolls)
        tiles8((const int8_t*)c, rb, s, 32, G, x, K, m0, F, R, out);
      else
        tiles8((const int8_t*)c, rb, s, 16, G, x, K, m0, F, R, out);
      for (int f = 0; f < F; f++) {
        zero_terms(z + f * G * gb, f16, xsum, G, m0, R, F, out + f);
        for (int r = 0; r < R; r++)
          y[(m0 + r) * N + n + f] = out[r * F + f] + (bias ? bias[n + f] : 0.0f);
      }
    }
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
