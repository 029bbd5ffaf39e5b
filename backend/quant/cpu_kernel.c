// sgl's CPU kernels for QuantizedWeight (backend/quant/weight.py): y = x @ W^T + b with W
// kept as integer codes and per-group float scale/zero (float32, or float16 where that is
// exact: `f16`; widened to float32 four features at a time, group_floats), activations float32.
//
//   y[m, n] = sum_k w[n, k] * x[m, k],   w[n, k] = code[n, k] * scale[n, g] + zero[n, g]
//
// Each weight is rebuilt in registers as the reference rebuilds it (weight.py `dequantize`: a
// float32 product, then a float32 sum, two roundings), so a product is a float32 matmul of the
// reference's weights, in the kernel's summation order. 4-bit codes on AVX-512 look their
// weight up in a 16-entry table per group (code * scale + zero for codes 0..15: one permute per
// 16 weights, the table two instructions per group); elsewhere a code is converted, multiplied
// and added. Each output's order is fixed: lane i of a 16-lane accumulator (or of a pair of
// 8-lane ones) takes k = 32 g + i, then k + 16, group by group (groups of 16: k = 16 g + i),
// and the lanes are summed last. So an output has the same bits at one row as in a batch of 32
// (verify rows and jumped tokens equal plain decoding) and on AVX2 as on AVX-512. A tile of four
// features rebuilds a group's weights once for up to five rows (AVX2: four), so an extra row
// costs its multiply-adds, two per 32 weights on AVX-512. Threads split the output features
// (OpenMP: the same libgomp torch loaded, so the same thread pool). Built at install time
// (setup.py) or at first use (cpu_kernel.py); cpu_build.py holds the sources, flags and key.
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"
#if SGL_X86
#include <cpuid.h>
#endif
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
#if SGL_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return 0;
#endif
}

#ifndef SGL_SOURCE_KEY
#define SGL_SOURCE_KEY ""
#endif
// The hash of the sources and flags this library was built from (cpu_build.source_key): a
// library built at install time whose key no longer matches its sources is not loaded.
const char* sgl_source_key(void) { return SGL_SOURCE_KEY; }

int sgl_cpu_ok(void) {
  use_avx512 = avx512_present();
#if SGL_X86
  __builtin_cpu_init();
  unsigned a, b, c, d;  // F16C from CPUID (leaf 1, ECX bit 29): not every compiler names it
  int f16c = __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
#else
  return 1;  // (portable C: any CPU)
#endif
}

// Whether this build is the portable one (cpu_portable.h: not x86-64, or SGL_PORTABLE).
int sgl_portable(void) { return !SGL_X86; }

// Turn the AVX-512 loops on (where the CPU has them) or off (tests compare both); returns
// whether they are on now.
int sgl_use_avx512(int on) {
  use_avx512 = on && avx512_present();
  return use_avx512;
}

int sgl_avx512_on(void) { return use_avx512; }

// code * scale, then + zero: the reference's two roundings. `fused`: one multiply-add, the
// same value where scales are float16 values (`f16`): code * scale then has at most 8 + 11
// significant bits, so it is exact and only the sum rounds.
AVX2 INLINE __m256 weights8(__m256i codes, __m256 s, __m256 z, const int fused) {
  __m256 q = _mm256_cvtepi32_ps(codes);
  return fused ? _mm256_fmadd_ps(q, s, z) : _mm256_add_ps(_mm256_mul_ps(q, s), z);
}

#if SGL_X86
AVX512 INLINE __m512 weights16(__m512 q, __m512 s, __m512 z, const int fused) {
  return fused ? _mm512_fmadd_ps(q, s, z) : _mm512_add_ps(_mm512_mul_ps(q, s), z);
}

// An accumulator's lanes summed, in the one order both instruction sets share: lanes 0-7 plus
// lanes 8-15, then hsum8. AVX-512: one 16-lane vector; AVX2: a pair of 8-lane ones.
AVX512 INLINE float hsum16(__m512 a) {
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
}
#endif

AVX2 INLINE float hsum_pair(const __m256 a[2]) { return hsum8(_mm256_add_ps(a[0], a[1])); }

#if SGL_X86
// 4-bit codes, AVX-512: features f < F (codes c + f * rb; scales s and zeros z [F, G]) by rows
// r < R of x (from row m0). A group's 16 bytes widen to 16 dword lanes (byte i: code i in its
// low nibble, code i + 16 in its high one); the permute reads a lane's low four bits, so the
// low nibbles index the group's table as they are and the high ones after a shift. Each
// (feature, row) is one 16-lane accumulator, two multiply-adds per group. out[r * F + f]. F
// and R are constants at each call (tiles4_512's switch), so the accumulators stay in
// registers; the codes PREFETCH_ROWS features further on are requested as we go.
AVX512 INLINE void tile4_512(const uint8_t* c, int64_t rb, const float* s, const float* z,
                             int64_t G, const float* x, int64_t K, int64_t m0, const int F,
                             const int R, const int fused, float* out) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[TILE_FEATURES][TILE_ROWS];
  UNROLL for (int f = 0; f < F; f++)
    UNROLL for (int r = 0; r < R; r++) acc[f][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m512 lo[TILE_FEATURES], hi[TILE_FEATURES];
    UNROLL for (int f = 0; f < F; f++) {
      _mm_prefetch((const char*)c + (PREFETCH_ROWS + f) * rb + g * 16, _MM_HINT_T0);
      __m512 table = weights16(iota, _mm512_set1_ps(s[f * G + g]), _mm512_set1_ps(z[f * G + g]),
                               fused);
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + f * rb + g * 16)));
      lo[f] = _mm512_permutexvar_ps(b, table);
      hi[f] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    }
    UNROLL for (int r = 0; r < R; r++) {
      const float* xg = x + (m0 + r) * K + g * 32;
      __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
      UNROLL for (int f = 0; f < F; f++)
        acc[f][r] = _mm512_fmadd_ps(hi[f], x1, _mm512_fmadd_ps(lo[f], x0, acc[f][r]));
    }
  }
  UNROLL for (int r = 0; r < R; r++)
    UNROLL for (int f = 0; f < F; f++) out[r * F + f] = hsum16(acc[f][r]);
}
#endif

// tile4_512 on 8-lane vectors (CPUs without AVX-512): the same bits, each 16-lane vector a pair
// (lanes 0-7 from bytes 0-7, lanes 8-15 from bytes 8-15); weights converted, not looked up. A
// feature's weights are rebuilt when its turn comes (16 registers: F * R <= 4).
AVX2 INLINE void tile4_256(const uint8_t* c, int64_t rb, const float* s, const float* z,
                           int64_t G, const float* x, int64_t K, int64_t m0, const int F,
                           const int R, const int fused, float* out) {
  const __m256i lo4 = _mm256_set1_epi32(0x0F);
  __m256 acc[TILE_FEATURES][TILE_ROWS][2];
  UNROLL for (int f = 0; f < F; f++)
    UNROLL for (int r = 0; r < R; r++) acc[f][r][0] = acc[f][r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    UNROLL for (int f = 0; f < F; f++) {
      const uint8_t* p = c + f * rb + g * 16;
      _mm_prefetch((const char*)c + (PREFETCH_ROWS + f) * rb + g * 16, _MM_HINT_T0);
      __m256 sg = _mm256_broadcast_ss(s + f * G + g), zg = _mm256_broadcast_ss(z + f * G + g);
      __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
      __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
      __m256 w0 = weights8(_mm256_and_si256(b0, lo4), sg, zg, fused);  // k = 32 g + 0..7
      __m256 w1 = weights8(_mm256_and_si256(b1, lo4), sg, zg, fused);  // 8..15
      __m256 w2 = weights8(_mm256_srli_epi32(b0, 4), sg, zg, fused);   // 16..23
      __m256 w3 = weights8(_mm256_srli_epi32(b1, 4), sg, zg, fused);   // 24..31
      UNROLL for (int r = 0; r < R; r++) {
        const float* xg = x + (m0 + r) * K + g * 32;
        acc[f][r][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16),
                                       _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), acc[f][r][0]));
        acc[f][r][1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24),
                                       _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), acc[f][r][1]));
      }
    }
  }
  UNROLL for (int r = 0; r < R; r++)
    UNROLL for (int f = 0; f < F; f++) out[r * F + f] = hsum_pair(acc[f][r]);
}

#if SGL_X86
// 8-bit codes in groups of GS (16 or 32), AVX-512: as tile4_512 with each weight converted (16
// codes sign-extended, converted, scaled, shifted); GS / 16 multiply-adds per group and
// (feature, row). Its rows of codes are twice a 4-bit row's bytes, so the prefetch looks half
// as many features ahead.
AVX512 INLINE void tile8_512(const int8_t* c, int64_t rb, const float* s, const float* z,
                             const int GS, int64_t G, const float* x, int64_t K, int64_t m0,
                             const int F, const int R, const int fused, float* out) {
  __m512 acc[TILE_FEATURES][TILE_ROWS];
  UNROLL for (int f = 0; f < F; f++)
    UNROLL for (int r = 0; r < R; r++) acc[f][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m512 w[TILE_FEATURES][2];
    UNROLL for (int f = 0; f < F; f++) {
      _mm_prefetch((const char*)c + (PREFETCH_ROWS / 2 + f) * rb + g * GS, _MM_HINT_T0);
      __m512 sg = _mm512_set1_ps(s[f * G + g]), zg = _mm512_set1_ps(z[f * G + g]);
      UNROLL for (int v = 0; v < GS / 16; v++) {
        const int8_t* p = c + f * rb + g * GS + v * 16;
        __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
        w[f][v] = weights16(_mm512_cvtepi32_ps(q), sg, zg, fused);
      }
    }
    UNROLL for (int r = 0; r < R; r++) {
      const float* xg = x + (m0 + r) * K + g * GS;
      UNROLL for (int v = 0; v < GS / 16; v++) {
        __m512 xv = _mm512_loadu_ps(xg + v * 16);
        UNROLL for (int f = 0; f < F; f++) acc[f][r] = _mm512_fmadd_ps(w[f][v], xv, acc[f][r]);
      }
    }
  }
  UNROLL for (int r = 0; r < R; r++)
    UNROLL for (int f = 0; f < F; f++) out[r * F + f] = hsum16(acc[f][r]);
}
#endif

// tile8_512 on 8-lane vectors: the same bits (each 16-lane vector a pair), F * R <= 4.
AVX2 INLINE void tile8_256(const int8_t* c, int64_t rb, const float* s, const float* z,
                           const int GS, int64_t G, const float* x, int64_t K, int64_t m0,
                           const int F, const int R, const int fused, float* out) {
  __m256 acc[TILE_FEATURES][TILE_ROWS][2];
  UNROLL for (int f = 0; f < F; f++)
    UNROLL for (int r = 0; r < R; r++) acc[f][r][0] = acc[f][r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    UNROLL for (int f = 0; f < F; f++) {
      const int8_t* p = c + f * rb + g * GS;
      _mm_prefetch((const char*)c + (PREFETCH_ROWS / 2 + f) * rb + g * GS, _MM_HINT_T0);
      __m256 sg = _mm256_broadcast_ss(s + f * G + g), zg = _mm256_broadcast_ss(z + f * G + g);
      __m256 w[4];  // codes i * 8 .. i * 8 + 7 of the group
      UNROLL for (int i = 0; i < GS / 8; i++)
        w[i] = weights8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + i * 8))), sg, zg,
                        fused);
      UNROLL for (int r = 0; r < R; r++) {
        const float* xg = x + (m0 + r) * K + g * GS;
        UNROLL for (int v = 0; v < GS / 16; v++)
          UNROLL for (int h = 0; h < 2; h++)
            acc[f][r][h] = _mm256_fmadd_ps(w[2 * v + h], _mm256_loadu_ps(xg + 16 * v + 8 * h),
                                           acc[f][r][h]);
      }
    }
  }
  UNROLL for (int r = 0; r < R; r++)
    UNROLL for (int f = 0; f < F; f++) out[r * F + f] = hsum_pair(acc[f][r]);
}

// The tile shapes, as constants: on AVX-512 up to four features by up to five rows (a 1 +
// 4-draft verify step in one tile); on AVX2 four features of one row, or one feature by up to
// four rows.
#define ROW_CASES(CALL, F_)                                           \
  switch (R) {                                                        \
    case 1: CALL(F_, 1); break; case 2: CALL(F_, 2); break;           \
    case 3: CALL(F_, 3); break; case 4: CALL(F_, 4); break;           \
    default: CALL(F_, 5); break; }
#define ROW_CASES4(CALL, F_)                                          \
  switch (R) {                                                        \
    case 1: CALL(F_, 1); break; case 2: CALL(F_, 2); break;           \
    case 3: CALL(F_, 3); break; default: CALL(F_, 4); break; }
#define FEATURE_CASES(CALL)                                           \
  switch (F) {                                                        \
    case 1: CALL(1, 1); break; case 2: CALL(2, 1); break;             \
    case 3: CALL(3, 1); break; default: CALL(4, 1); break; }
#define FEATURE_ROW_CASES(CALL)                                       \
  switch (F) {                                                        \
    case 1: ROW_CASES(CALL, 1) break; case 2: ROW_CASES(CALL, 2) break; \
    case 3: ROW_CASES(CALL, 3) break; default: ROW_CASES(CALL, 4) break; }
// Features one at a time, each by R rows, into out[r * F + f].
#define BY_FEATURE(CALL)                                              \
  for (int f = 0; f < F; f++) {                                       \
    float part[TILE_ROWS];                                            \
    const int64_t sf = f * G, cf = f * rb;                            \
    ROW_CASES4(CALL, 1)                                               \
    for (int r = 0; r < R; r++) out[r * F + f] = part[r];             \
  }

// Each tile shape twice: with the rebuild fused (float16 scales) and not.
#define BOTH(CASES) \
  if (fused) { const int FU = 1; CASES } else { const int FU = 0; CASES }

#if SGL_X86
#define T4_512(F_, R_) tile4_512(c, rb, s, z, G, x, K, m0, F_, R_, FU, out)
AVX512 static void tiles4_512(const uint8_t* c, int64_t rb, const float* s, const float* z,
                              int64_t G, const float* x, int64_t K, int64_t m0, int F, int R,
                              int fused, float* out) {
  BOTH(FEATURE_ROW_CASES(T4_512))
}

#define T8_512(F_, R_) tile8_512(c, rb, s, z, GS, G, x, K, m0, F_, R_, FU, out)
AVX512 static void tiles8_512(const int8_t* c, int64_t rb, const float* s, const float* z,
                              const int GS, int64_t G, const float* x, int64_t K, int64_t m0,
                              int F, int R, int fused, float* out) {
  BOTH(FEATURE_ROW_CASES(T8_512))
}
#else  // (no AVX-512 twins off x86-64: use_avx512 stays 0 there, so these are never called)
#define tiles4_512(...) abort()
#define tiles8_512(...) abort()
#endif

#define T4_256(F_, R_) tile4_256(c, rb, s, z, G, x, K, m0, F_, R_, FU, out)
#define T4_256_PART(F_, R_) tile4_256(c + cf, rb, s + sf, z + sf, G, x, K, m0, F_, R_, FU, part)
AVX2 static void tiles4_256(const uint8_t* c, int64_t rb, const float* s, const float* z,
                            int64_t G, const float* x, int64_t K, int64_t m0, int F, int R,
                            int fused, float* out) {
  if (R == 1) {
    BOTH(FEATURE_CASES(T4_256))
  } else {
    BOTH(BY_FEATURE(T4_256_PART))
  }
}

#define T8_256(F_, R_) tile8_256(c, rb, s, z, GS, G, x, K, m0, F_, R_, FU, out)
#define T8_256_PART(F_, R_) tile8_256(c + cf, rb, s + sf, z + sf, GS, G, x, K, m0, F_, R_, FU, part)
AVX2 INLINE void tiles8_256(const int8_t* c, int64_t rb, const float* s, const float* z,
                            const int GS, int64_t G, const float* x, int64_t K, int64_t m0,
                            int F, int R, int fused, float* out) {
  if (R == 1) {
    BOTH(FEATURE_CASES(T8_256))
  } else {
    BOTH(BY_FEATURE(T8_256_PART))
  }
}

int64_t sgl_qlinear_blocks(int64_t N) { return (N + N_BLOCK - 1) / N_BLOCK; }

// Output features [blk * N_BLOCK, ...) of every row: the unit threads share out, in tiles of
// four features (their float16 scales and zeros widened together, group_floats) by up to five
// rows. An output's bits do not depend on the tile that computed it, so any split of the blocks
// over threads, and any number of rows, gives the same bits (verify rows and jumped tokens
// equal plain decoding).
AVX2 void sgl_qlinear_block(int bits, int gs, const float* x, int64_t M, int64_t K,
                            const void* codes, const void* scale, const void* zero, int f16,
                            int64_t N, const float* bias, float* y, int64_t blk) {
  int64_t G = K / gs, gb = group_bytes(f16);
  int64_t rb = bits == 4 ? K / 2 : K;  // code bytes per feature
  int64_t end = (blk + 1) * N_BLOCK < N ? (blk + 1) * N_BLOCK : N;
  float sbuf[f16 ? TILE_FEATURES * G : 1], zbuf[f16 ? TILE_FEATURES * G : 1];
  float out[TILE_FEATURES * TILE_ROWS];
  const int rows = use_avx512 ? TILE_ROWS : 4;  // (AVX2: five rows spill its 16 registers)
  for (int64_t n = blk * N_BLOCK; n < end; n += TILE_FEATURES) {
    int F = (int)(end - n < TILE_FEATURES ? end - n : TILE_FEATURES);
    const float* s = group_floats((const char*)scale + n * G * gb, f16, F * G, sbuf);
    const float* z = group_floats((const char*)zero + n * G * gb, f16, F * G, zbuf);
    const uint8_t* c = (const uint8_t*)codes + n * rb;
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      int R = (int)(M - m0 < rows ? M - m0 : rows);
      if (bits == 4 && use_avx512)
        tiles4_512(c, rb, s, z, G, x, K, m0, F, R, f16, out);
      else if (bits == 4)
        tiles4_256(c, rb, s, z, G, x, K, m0, F, R, f16, out);
      else if (use_avx512 && gs == 32)  // (constant group sizes: the inner loops unroll)
        tiles8_512((const int8_t*)c, rb, s, z, 32, G, x, K, m0, F, R, f16, out);
      else if (use_avx512)
        tiles8_512((const int8_t*)c, rb, s, z, 16, G, x, K, m0, F, R, f16, out);
      else if (gs == 32)
        tiles8_256((const int8_t*)c, rb, s, z, 32, G, x, K, m0, F, R, f16, out);
      else
        tiles8_256((const int8_t*)c, rb, s, z, 16, G, x, K, m0, F, R, f16, out);
      for (int f = 0; f < F; f++)
        for (int r = 0; r < R; r++)
          y[(m0 + r) * N + n + f] = out[r * F + f] + (bias ? bias[n + f] : 0.0f);
    }
  }
}

// x [M, K], y [M, N] float32 row-major; codes/scale/zero as in weight.py (scale and zero
// float16 when f16, else float32); bias may be NULL.
AVX2 void sgl_qlinear(int bits, int gs, const float* x, int64_t M, int64_t K, const void* codes,
                      const void* scale, const void* zero, int f16, int64_t N,
                      const float* bias, float* y, int threads) {
  int64_t blocks = sgl_qlinear_blocks(N);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t blk = 0; blk < blocks; blk++)
    sgl_qlinear_block(bits, gs, x, M, K, codes, scale, zero, f16, N, bias, y, blk);
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
