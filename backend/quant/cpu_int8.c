// sgl's integer-activation CPU kernels for QuantizedWeight (weight.py), the opt-in
// `activation_quantization="int8"`: the input of a projection is quantized per group of the
// weight (32, or 16 for 16-wide 8-bit groups) to int8 with one float32 scale, and each group's
// dot product runs on integers (AVX2: _mm256_maddubs_epi16 makes 32 multiply-adds of unsigned
// by signed bytes into 16 int16 pairs, _mm256_madd_epi16 widens them to 8 int32).
//
//   qx[m, g, :], dx[m, g] = round(x[m, g, :] / dx), dx = max|x[m, g, :]| / 127  (ggml's Q8_0)
//   y[m, n] = sum_g scale[n, g] * dx[m, g] * idot(code[n, g, :], qx[m, g, :])
//             + zero[n, g] * xsum[m, g]                                        (+ bias[n])
//
// Only the scale term is approximated: the zero term uses the exact float sums of x per group
// (xsum). Rounding is to nearest, ties to even (the CPU's default mode; torch.round is the
// same), so the pure-torch reference (cpu_int8.py) reproduces qx and dx bit for bit and the
// result up to float32 summation order.
//
// Codes: bits 4, a group's 16 bytes hold codes 0..15 in their low nibbles and 16..31 in their
// high ones, so [low | high] is the group in x's order and its unsigned values go straight into
// maddubs. bits 8 (signed): maddubs(|c|, qx * sign(c)), the sign moved onto the activation.
// A pair sum stays in int16: 4-bit 2 * 15 * 127, 8-bit 2 * 128 * 127 < 32768.
//
// The 32 bytes one instruction takes are a "step": 4-bit, two groups (64 values: their low
// nibbles, then their high nibbles, so qx of a pair of groups is stored as [g0 0-15, g1 0-15,
// g0 16-31, g1 16-31] and one 32-byte load of codes serves both); 8-bit/16, two groups; 8-bit/32
// one. The scales of a step are laid out as 8 floats matching its int32 lanes (a pair: the
// first group in lanes 0-3), the activation's once per call (d8), the weight's once per tile
// of features and chunk of rows (on the stack), so the inner loop's float work is one convert,
// one multiply and one FMA, both with a memory operand.
//
// Work is split in the float kernel's blocks of 16 output features (sgl_qlinear_blocks), so
// the decode step's team (cpu_layer.c) shares it the same way. Within a block, chunks of up to
// 64 rows go past tiles of 2 features (a single row: 4 for 4-bit codes, one for 8-bit, where
// the product is bound by the bytes) whose codes stay in L1, 4 rows at
// a time: a prefill of hundreds of rows is then bound by the multiply-adds, not by bandwidth
// (on the AVX2 VM still slower than BLAS on the dequantized weight, so quant_linear sends
// products above linear.INT8_MAX_ROWS rows there).
#include <stdint.h>
#include <stdlib.h>

#include "cpu_api.h"
#include "cpu_simd.h"
#define Q8_BLOCK 16  // output features per block: the float kernel's N_BLOCK (cpu_kernel.c)
#define Q8_ROWS 4    // rows per tile
#define Q8_CHUNK 64  // rows per chunk (the weight scales of a tile are laid out once per chunk)

AVX2 INLINE float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 floats -> 8 int32, rounded to nearest even.
AVX2 INLINE __m256i round8(__m256 v, __m256 id) {
  return _mm256_cvtps_epi32(_mm256_mul_ps(v, id));
}


// Values per step and steps per row (the remainder: one 32- or 16-group, `tail`).
INLINE int64_t step_values(int bits) { return bits == 4 ? 64 : 32; }
INLINE int paired(int bits, int gs) { return bits == 4 || gs == 16; }

// The activation buffer (floats): qx [M, K] int8, dx [M, G], then per step the 8 lanes of
// d8 [M, S, 8] (the activation scale of each lane's group) and x8 [M, S, 8] (the group's float
// sum divided by the lanes it spans, 4 or 8: the 8 lanes of zero * x8 add up to the step's
// zero term, exactly scaled by a power of two). sgl_q8_floats gives the size.
typedef struct {
  int8_t* qx;
  float *dx, *d8, *x8;
  int64_t G, S;
} q8_act;

// Offsets in floats, each a multiple of 8 (32 bytes).
INLINE int64_t dx_at(int64_t M, int64_t K) { return (M * K + 31) / 32 * 8; }
INLINE int64_t d8_at(int64_t M, int64_t K, int64_t G) { return dx_at(M, K) + (M * G + 7) / 8 * 8; }

INLINE q8_act act_layout(float* buf, int bits, int gs, int64_t M, int64_t K) {
  q8_act a;
  a.G = K / gs;
  a.S = K / step_values(bits);
  a.qx = (int8_t*)buf;
  a.dx = buf + dx_at(M, K);
  a.d8 = buf + d8_at(M, K, a.G);
  a.x8 = a.d8 + M * a.S * 8;
  return a;
}

// Floats of the activation buffer of M rows: at most 0.8 * M * K + 16 (cpu_layer.c's xp).
int64_t sgl_q8_floats(int bits, int gs, int64_t M, int64_t K) {
  return d8_at(M, K, K / gs) + 2 * M * (K / step_values(bits)) * 8;
}

// One group of `gs` (16 or 32) floats -> int8 codes, its scale, its exact float sum (the 8-lane
// partials in order, then across lanes: the reference's tolerance covers the order). `out`
// gets 16-byte halves at out and out + `second` (natural order: second = 16).
AVX2 INLINE void quantize_group(const float* x, const int gs, int8_t* out, int64_t second,
                                float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
  for (int i = 0; i < gs / 8; i++) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    sum = _mm256_add_ps(sum, v[i]);
  }
  float dm = hmax8(amax) / 127.0f;
  __m256 id = _mm256_set1_ps(dm != 0.0f ? 1.0f / dm : 0.0f);
  *d = dm;
  *s = hsum8(sum);
  for (int h = 0; h < gs / 16; h++) {  // 16 values -> 16 bytes
    __m256i a = _mm256_packs_epi32(round8(v[2 * h], id), round8(v[2 * h + 1], id));
    __m128i w = _mm_packs_epi16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    // w's 4-byte words hold values 0-3, 8-11, 4-7, 12-15
    _mm_storeu_si128((__m128i*)(out + h * second), _mm_shuffle_epi32(w, _MM_SHUFFLE(3, 1, 2, 0)));
  }
}

// A per-group row of floats v [G] as step lanes [S, 8], each value times `mul`.
AVX2 INLINE void lanes(int bits, int gs, const float* v, int64_t S, float mul, float* out) {
  const __m256 k = _mm256_set1_ps(mul);
  for (int64_t p = 0; p < S; p++) {
    __m256 l = paired(bits, gs) ? _mm256_set_m128(_mm_broadcast_ss(v + 2 * p + 1),
                                                  _mm_broadcast_ss(v + 2 * p))
                                : _mm256_broadcast_ss(v + p);
    _mm256_storeu_ps(out + p * 8, _mm256_mul_ps(l, k));
  }
}

// x [M, K] float32 -> the activation buffer `buf` (act_layout) and xsum [M, G].
AVX2 void sgl_q8_quantize(int bits, int gs, const float* x, int64_t M, int64_t K, float* buf,
                          float* xsum, int threads) {
  const q8_act a = act_layout(buf, bits, gs, M, K);
  const int64_t G = a.G, S = a.S;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 32)
  for (int64_t m = 0; m < M; m++) {
    for (int64_t g = 0; g < G; g++) {
      int64_t i = m * G + g, k = g * gs;
      // 4-bit pairs: group 2p's halves at +0 and +32, group 2p+1's at +16 and +48
      int in_pair = bits == 4 && g / 2 < S;
      int64_t at = in_pair ? (g & ~(int64_t)1) * 32 + (g & 1) * 16 : k;
      if (gs == 32)
        quantize_group(x + m * K + k, 32, a.qx + m * K + at, in_pair ? 32 : 16, a.dx + i, xsum + i);
      else
        quantize_group(x + m * K + k, 16, a.qx + m * K + at, 16, a.dx + i, xsum + i);
    }
    lanes(bits, gs, a.dx + m * G, S, 1.0f, a.d8 + m * S * 8);
    lanes(bits, gs, xsum + m * G, S, paired(bits, gs) ? 0.25f : 0.125f, a.x8 + m * S * 8);
  }
}

// 8 int32 partial dot products of one step: codes (registers) against the activation bytes at
// q. 4-bit: c0/c1 the low/high nibbles of two groups, q their pair layout; 8-bit: c0 = |code|,
// c1 = code (the sign goes onto the activation). Pair sums stay in int16 (4-bit: two of
// 2 * 15 * 127; 8-bit: 2 * 128 * 127).
AVX2 INLINE __m256i step_dot(const int bits, __m256i c0, __m256i c1, const int8_t* q) {
  __m256i p;
  if (bits == 4)
    p = _mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_loadu_si256((const __m256i*)q)),
                         _mm256_maddubs_epi16(c1, _mm256_loadu_si256((const __m256i*)(q + 32))));
  else
    p = _mm256_maddubs_epi16(c0, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)q), c1));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// Step p's codes of one feature into (c0, c1) as step_dot takes them.
AVX2 INLINE void step_codes(const int bits, const void* codes, int64_t p, __m256i* c0,
                            __m256i* c1) {
  __m256i v = _mm256_loadu_si256((const __m256i*)((const uint8_t*)codes + p * 32));
  if (bits == 4) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    *c0 = _mm256_and_si256(v, m4);
    *c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  } else {
    *c0 = _mm256_sign_epi8(v, v);
    *c1 = v;
  }
}

// Where a tile's weight scales come from. ONE_ROW: straight from scale [F, G] (a single row:
// laying them out would cost as much as using them; the zero term is `finish`'s). Else from
// the lanes sv [F, S, 8], with (Z) the zero term from zv [F, S, 8] against the rows' x8.
enum { ONE_ROW = 0, LAID = 1, LAID_ZERO = 2 };

// R rows x F features over the S steps: out[r * F + f]. qx, d8, x8: the tile's first row;
// codes: its first feature (`cstride` bytes per feature).
AVX2 INLINE void tile(const int bits, const int gs, const int mode, const int R, const int F,
                      const int8_t* qx, const float* d8, const float* x8, int64_t K, int64_t S,
                      const void* codes, int64_t cstride, const float* sv, const float* zv,
                      int64_t G, float* out) {
  __m256 acc[Q8_ROWS][4];
  for (int r = 0; r < R; r++)
    for (int f = 0; f < F; f++) acc[r][f] = _mm256_setzero_ps();
  const int64_t width = step_values(bits);
  for (int64_t p = 0; p < S; p++) {
    __m256i c0[4], c1[4];
    __m256 s[4];
    // One row: fetch the next tile's codes and scales ahead; F streams at once are more than
    // the hardware prefetcher follows (the 4-bit one-row tile measured ~1.3x faster with it).
    if (mode == ONE_ROW)
      for (int f = 0; f < F; f++) {
        _mm_prefetch((const char*)codes + (F + f) * cstride + p * 32, _MM_HINT_T0);
        if (p * 16 < G) _mm_prefetch((const char*)(sv + (F + f) * G + p * 16), _MM_HINT_T0);
      }
    for (int f = 0; f < F; f++) {
      step_codes(bits, (const uint8_t*)codes + f * cstride, p, &c0[f], &c1[f]);
      if (mode == ONE_ROW)
        s[f] = paired(bits, gs) ? _mm256_set_m128(_mm_broadcast_ss(sv + f * G + 2 * p + 1),
                                                  _mm_broadcast_ss(sv + f * G + 2 * p))
                                : _mm256_broadcast_ss(sv + f * G + p);
    }
    for (int r = 0; r < R; r++) {
      const int8_t* q = qx + r * K + p * width;
      const __m256 d = _mm256_loadu_ps(d8 + (r * S + p) * 8);
      for (int f = 0; f < F; f++) {
        __m256 v = _mm256_cvtepi32_ps(step_dot(bits, c0[f], c1[f], q));
        v = _mm256_mul_ps(v, mode == ONE_ROW ? s[f] : _mm256_loadu_ps(sv + (f * S + p) * 8));
        acc[r][f] = _mm256_fmadd_ps(v, d, acc[r][f]);
      }
      if (mode == LAID_ZERO) {
        const __m256 xs = _mm256_loadu_ps(x8 + (r * S + p) * 8);
        for (int f = 0; f < F; f++)
          acc[r][f] = _mm256_fmadd_ps(_mm256_loadu_ps(zv + (f * S + p) * 8), xs, acc[r][f]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int f = 0; f < F; f++) out[r * F + f] = hsum8(acc[r][f]);
}

#define TILE_ARGS qx, d8, x8, K, S, codes, cstride, sv, zv, G, out
#define TILE_BITS(MODE, R, F)                                      \
  if (bits == 4) tile(4, 32, MODE, R, F, TILE_ARGS);               \
  else if (gs == 32) tile(8, 32, MODE, R, F, TILE_ARGS);           \
  else tile(8, 16, MODE, R, F, TILE_ARGS);
#define TILE_MODES(R, F)                                                  \
  if (mode == LAID_ZERO) { TILE_BITS(LAID_ZERO, R, F) } else { TILE_BITS(LAID, R, F) }

// Compile-time format, mode, R and F, so the accumulators stay in registers. ONE_ROW: R 1, F 4
// or 1; otherwise R 1..4, F 2 or 1.
AVX2 static void run_tile(int bits, int gs, int mode, int R, int F, const int8_t* qx,
                          const float* d8, const float* x8, int64_t K, int64_t S,
                          const void* codes, int64_t cstride, const float* sv, const float* zv,
                          int64_t G, float* out) {
  if (mode == ONE_ROW) {
    if (F == 4) { TILE_BITS(ONE_ROW, 1, 4) } else { TILE_BITS(ONE_ROW, 1, 1) }
    return;
  }
  switch (R * 8 + F) {
    case 8 + 2: { TILE_MODES(1, 2) return; }
    case 16 + 2: { TILE_MODES(2, 2) return; }
    case 24 + 2: { TILE_MODES(3, 2) return; }
    case 32 + 2: { TILE_MODES(4, 2) return; }
    case 8 + 1: { TILE_MODES(1, 1) return; }
    case 16 + 1: { TILE_MODES(2, 1) return; }
    case 24 + 1: { TILE_MODES(3, 1) return; }
    default: { TILE_MODES(4, 1) return; }
  }
}

// The last group outside the steps (4-bit or 8-bit/16 with an odd number of groups), scalar:
// codes of that group in x's order are rebuilt from the packed form.
static int32_t tail_dot(int bits, int gs, const int8_t* q, const void* codes) {
  int32_t t = 0;
  for (int i = 0; i < gs; i++) {
    int c = bits == 4 ? (((const uint8_t*)codes)[i % 16] >> (i < 16 ? 0 : 4)) & 0xF
                      : ((const int8_t*)codes)[i];
    t += c * q[i];
  }
  return t;
}


// y for rows [m, m + R) and features [n, n + F) from the tile's sums `out`: the trailing
// group, the zero terms the tile left out (ONE_ROW: all; otherwise the trailing group's), bias.
// scale, zero: the tile's F features' [F, G] (float32).
AVX2 static void finish(int bits, int gs, int mode, const q8_act* a, const float* xsum,
                        int64_t K, const void* codes, int64_t cstride, const float* scale,
                        const float* zero, int64_t N, const float* bias, int64_t m, int R,
                        int64_t n, int F, const float* out, float* y) {
  const int64_t G = a->G, k_tail = a->S * step_values(bits);
  for (int r = 0; r < R; r++)
    for (int f = 0; f < F; f++) {
      int64_t row = m + r, feat = n + f;
      const float *z = zero + f * G, *xs = xsum + row * G;
      float v = out[r * F + f];
      if (k_tail < K) {
        const uint8_t* c =
            (const uint8_t*)codes + feat * cstride + (bits == 4 ? k_tail / 2 : k_tail);
        v += scale[f * G + G - 1] * a->dx[row * G + G - 1] *
             (float)tail_dot(bits, gs, a->qx + row * K + k_tail, c);
      }
      if (mode == ONE_ROW) v += zero_term(z, 0, xs, G);
      else if (k_tail < K) v += z[G - 1] * xs[G - 1];
      y[row * N + feat] = v + (bias ? bias[feat] : 0.0f);
    }
}

// Any nonzero zero among F features' G groups (Q8_0, Q6_K have none: their tiles skip it).
static int any_zero(const float* zero, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (zero[i] != 0.0f) return 1;
  return 0;
}

// Output features [blk * Q8_BLOCK, ...) of every row, complete (zero term and bias added), from
// the activation buffer of sgl_q8_quantize. The tiles depend only on M and the block, so any
// split of the blocks over threads gives the same bits. scale, zero: float16 when f16 (each
// tile's widened first, group_floats), else float32.
AVX2 void sgl_q8_block(int bits, int gs, const float* buf, const float* xsum, int64_t M,
                       int64_t K, const void* codes, const void* scale_in, const void* zero_in,
                       int f16, int64_t N, const float* bias, float* y, int64_t blk) {
  const q8_act a = act_layout((float*)buf, bits, gs, M, K);
  const int64_t S = a.S, G = a.G, cstride = bits == 4 ? K / 2 : K;
  const int64_t n0 = blk * Q8_BLOCK, end = n0 + Q8_BLOCK < N ? n0 + Q8_BLOCK : N;
  const int64_t gb = f16 ? 2 : 4;  // bytes per scale or zero
  float lanes_s[2 * (S > 0 ? S : 1) * 8], lanes_z[2 * (S > 0 ? S : 1) * 8];
  float sbuf[f16 ? 4 * G : 1], zbuf[f16 ? 4 * G : 1];
  float out[Q8_ROWS * 4];
  for (int64_t m0 = 0; m0 < M; m0 += Q8_CHUNK) {
    const int64_t rows = M - m0 < Q8_CHUNK ? M - m0 : Q8_CHUNK;
    // (one row of 8-bit codes is bound by bandwidth: one feature at a time measured best)
    const int wide = rows == 1 ? (bits == 4 ? 4 : 1) : 2;
    for (int64_t n = n0; n < end;) {
      const int F = end - n >= wide ? wide : 1;
      int mode = ONE_ROW;
      const float* scale = group_floats((const char*)scale_in + n * G * gb, f16, F * G, sbuf);
      const float* zero = group_floats((const char*)zero_in + n * G * gb, f16, F * G, zbuf);
      const float *sv = scale, *zv = NULL;
      if (rows > 1) {
        for (int f = 0; f < F; f++) {
          lanes(bits, gs, scale + f * G, S, 1.0f, lanes_s + f * S * 8);
          lanes(bits, gs, zero + f * G, S, 1.0f, lanes_z + f * S * 8);
        }
        sv = lanes_s, zv = lanes_z;
        mode = any_zero(zero, F * G) ? LAID_ZERO : LAID;
      }
      const uint8_t* c = (const uint8_t*)codes + n * cstride;
      for (int64_t m = m0; m < m0 + rows; m += Q8_ROWS) {
        const int R = (int)(m0 + rows - m < Q8_ROWS ? m0 + rows - m : Q8_ROWS);
        run_tile(bits, gs, mode, R, F, a.qx + m * K, a.d8 + m * S * 8, a.x8 + m * S * 8, K, S,
                 c, cstride, sv, zv, G, out);
        finish(bits, gs, mode, &a, xsum, K, codes, cstride, scale, zero, N, bias, m, R, n, F,
               out, y);
      }
      n += F;
    }
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias) with x quantized per group (module comment). Threads split
// the blocks of output features (OpenMP, as sgl_qlinear). Returns -1 if out of memory.
AVX2 int sgl_q8_linear(int bits, int gs, const float* x, int64_t M, int64_t K, const void* codes,
                       const void* scale, const void* zero, int f16, int64_t N, const float* bias,
                       float* y, int threads) {
  float* buf = (float*)malloc(sizeof(float) * (size_t)sgl_q8_floats(bits, gs, M, K));
  float* xsum = (float*)malloc(sizeof(float) * (size_t)(M * (K / gs) + 1));
  if (buf == NULL || xsum == NULL) {
    free(buf);
    free(xsum);
    return -1;
  }
  sgl_q8_quantize(bits, gs, x, M, K, buf, xsum, threads);
  int64_t blocks = sgl_qlinear_blocks(N);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t blk = 0; blk < blocks; blk++)
    sgl_q8_block(bits, gs, buf, xsum, M, K, codes, scale, zero, f16, N, bias, y, blk);
  free(buf);
  free(xsum);
  return 0;
}
