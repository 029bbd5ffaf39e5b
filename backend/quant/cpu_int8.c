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
// Work is split in the float kernel's blocks of 16 output features (sgl_qlinear_blocks), so
// the decode step's team (cpu_layer.c) shares it the same way. Within a block the rows go by
// in tiles of up to 4, each tile against the block's features 2 or 4 at a time: the block's
// codes (16 * K bytes at most) stay in L1 while every row streams past them, which is what
// makes a prefill of hundreds of rows compute-bound instead of bandwidth-bound.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))
#define Q8_BLOCK 16  // output features per block: the float kernel's N_BLOCK (cpu_kernel.c)
#define Q8_ROWS 4    // rows per tile

int64_t sgl_qlinear_blocks(int64_t N);  // (cpu_kernel.c)

AVX2 INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

// One group of `gs` (16 or 32) floats -> qx (int8), its scale and its exact float sum. The
// sum adds the 8-lane partial vectors in order, then across lanes (the reference's tolerance
// covers the order).
AVX2 INLINE void quantize_group(const float* x, const int gs, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
  for (int i = 0; i < gs / 8; i++) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    sum = _mm256_add_ps(sum, v[i]);
  }
  float dm = hmax8(amax) / 127.0f;
  float inv = dm != 0.0f ? 1.0f / dm : 0.0f;
  __m256 id = _mm256_set1_ps(inv);
  *d = dm;
  *s = hsum8(sum);
  // int32 -> int16 -> int8 packs interleave the 128-bit lanes; the permute restores order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  if (gs == 32) {
    __m256i a = _mm256_packs_epi32(round8(v[0], id), round8(v[1], id));
    __m256i b = _mm256_packs_epi32(round8(v[2], id), round8(v[3], id));
    __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order);
    _mm256_storeu_si256((__m256i*)q, p);
  } else {
    __m256i a = _mm256_packs_epi32(round8(v[0], id), round8(v[1], id));  // [0-3 8-11 | 4-7 12-15]
    __m128i w = _mm_packs_epi16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    // w's bytes: 0-3 8-11 4-7 12-15 (as int32 lanes: 0, 2, 1, 3)
    _mm_storeu_si128((__m128i*)q, _mm_shuffle_epi32(w, _MM_SHUFFLE(3, 1, 2, 0)));
  }
}

// x [M, K] float32 -> qx [M, K] int8, dx [M, K / gs], xsum [M, K / gs] float32.
AVX2 void sgl_q8_quantize(const float* x, int64_t M, int64_t K, int gs, int8_t* qx, float* dx,
                          float* xsum, int threads) {
  int64_t G = K / gs;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 32)
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < G; g++) {
      int64_t i = m * G + g;
      if (gs == 32)
        quantize_group(x + i * 32, 32, qx + i * 32, dx + i, xsum + i);
      else
        quantize_group(x + i * 16, 16, qx + i * 16, dx + i, xsum + i);
    }
}

// One group's codes of one feature, as bytes in x's order: the unsigned 4-bit codes, or for
// 8 bits |code| (the sign goes onto the activation, `signed_x`). gs 16 holds two groups.
AVX2 INLINE __m256i load_codes(const int bits, const void* codes, int64_t off) {
  if (bits == 4) {
    __m128i b = _mm_loadu_si128((const __m128i*)((const uint8_t*)codes + off / 2));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  }
  return _mm256_loadu_si256((const __m256i*)((const int8_t*)codes + off));
}

// 8 int32 partial dot products of (codes c, activations q), 32 bytes each.
AVX2 INLINE __m256i idot(const int bits, __m256i c, __m256i q) {
  __m256i prod = bits == 4 ? _mm256_maddubs_epi16(c, q)
                           : _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(q, c));
  return _mm256_madd_epi16(prod, _mm256_set1_epi16(1));
}

// A group's scale as a vector for the 32 values of one step: gs 32 one value, gs 16 the
// scales of two groups (lanes 0-3 are the first group's int32 partials, 4-7 the second's).
AVX2 INLINE __m256 bcast(const int gs, const float* p) {
  if (gs == 32) return _mm256_broadcast_ss(p);
  return _mm256_set_m128(_mm_broadcast_ss(p + 1), _mm_broadcast_ss(p));
}

// The scale term of R rows x F features (feature f's codes `f * K` values after `codes`),
// summed over K's 32-wide steps below `kend`, into out[r * F + f]. A step is one group, or two
// for gs 16. Per (row, feature, step): maddubs, madd, convert, and two float ops.
AVX2 INLINE void tile(const int bits, const int gs, const int R, const int F, const int8_t* qx,
                      const float* dx, int64_t K, int64_t kend, const void* codes,
                      const float* scale, float* out) {
  const int64_t G = K / gs;
  const int64_t cstride = bits == 4 ? K / 2 : K;  // bytes of codes per feature
  __m256 acc[Q8_ROWS][4];
  for (int r = 0; r < R; r++)
    for (int f = 0; f < F; f++) acc[r][f] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kend; k += 32) {
    const int64_t g = k / gs;
    __m256i c[4];
    __m256 s[4];
    for (int f = 0; f < F; f++) {
      c[f] = load_codes(bits, (const uint8_t*)codes + f * cstride, k);
      s[f] = bcast(gs, scale + f * G + g);
    }
    for (int r = 0; r < R; r++) {
      __m256i q = _mm256_loadu_si256((const __m256i*)(qx + r * K + k));
      __m256 d = bcast(gs, dx + r * G + g);
      for (int f = 0; f < F; f++) {
        __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(idot(bits, c[f], q)), s[f]);
        acc[r][f] = _mm256_fmadd_ps(p, d, acc[r][f]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int f = 0; f < F; f++) out[r * F + f] = hsum8(acc[r][f]);
}

// The same for one trailing 16-wide group (gs 16 with an odd number of groups), 128-bit.
AVX2 static float tail16(const int8_t* qx, float dx, const int8_t* codes, float s) {
  __m128i c = _mm_loadu_si128((const __m128i*)codes);
  __m128i q = _mm_loadu_si128((const __m128i*)qx);
  __m128i p = _mm_maddubs_epi16(_mm_sign_epi8(c, c), _mm_sign_epi8(q, c));
  p = _mm_madd_epi16(p, _mm_set1_epi16(1));
  p = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(1, 0, 3, 2)));
  p = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(2, 3, 0, 1)));
  return s * dx * (float)_mm_cvtsi128_si32(p);
}

// Compile-time R, F and format, so the accumulators live in registers.
#define TILE_FORMATS(R, F)                                                          \
  if (bits == 4) tile(4, 32, R, F, qx, dx, K, K, codes, scale, out);                \
  else if (gs == 32) tile(8, 32, R, F, qx, dx, K, K, codes, scale, out);            \
  else tile(8, 16, R, F, qx, dx, K, K32, codes, scale, out);

// Rows [m, m + R) against features [n, n + F) (pointers already offset): y without zero terms.
AVX2 static void run_tile(int bits, int gs, int R, int F, const int8_t* qx, const float* dx,
                          int64_t K, const void* codes, const float* scale, float* out) {
  // gs 16: the 32-wide steps cover K32 = K rounded down to 32; an odd last group is added by
  // tail16 (the caller).
  const int64_t K32 = K & ~(int64_t)31;
  if (F == 4) {
    switch (R) {
      case 1: { TILE_FORMATS(1, 4) break; }
      default: { TILE_FORMATS(2, 4) break; }
    }
  } else if (F == 2) {
    switch (R) {
      case 3: { TILE_FORMATS(3, 2) break; }
      default: { TILE_FORMATS(4, 2) break; }
    }
  } else {
    switch (R) {
      case 1: { TILE_FORMATS(1, 1) break; }
      case 2: { TILE_FORMATS(2, 1) break; }
      case 3: { TILE_FORMATS(3, 1) break; }
      default: { TILE_FORMATS(4, 1) break; }
    }
  }
}

// sum over groups of zero[g] * xsum[g] (the exact zero term of one row and feature).
AVX2 INLINE float zero_term(const float* z, const float* xs, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(z + g), _mm256_loadu_ps(xs + g), acc);
  float t = hsum8(acc);
  for (; g < G; g++) t += z[g] * xs[g];
  return t;
}

// Output features [blk * Q8_BLOCK, ...) of every row, complete (zero term and bias added).
// The tiles a block is cut into depend only on M and the block, so any split of the blocks
// over threads gives the same bits.
AVX2 void sgl_q8_block(int bits, int gs, const int8_t* qx, const float* dx, const float* xsum,
                       int64_t M, int64_t K, const void* codes, const float* scale,
                       const float* zero, int64_t N, const float* bias, float* y, int64_t blk) {
  const int64_t G = K / gs, cstride = bits == 4 ? K / 2 : K;
  const int64_t n0 = blk * Q8_BLOCK, end = n0 + Q8_BLOCK < N ? n0 + Q8_BLOCK : N;
  const int64_t k_odd = gs == 16 && (G & 1) ? K - 16 : -1;  // a last 16-group outside the tiles
  float out[Q8_ROWS * 4];
  for (int64_t m = 0; m < M; m += Q8_ROWS) {
    const int R = (int)(M - m < Q8_ROWS ? M - m : Q8_ROWS);
    const int wide = R <= 2 ? 4 : 2;
    for (int64_t n = n0; n < end;) {
      const int F = end - n >= wide ? wide : 1;
      run_tile(bits, gs, R, F, qx + m * K, dx + m * G, K, (const uint8_t*)codes + n * cstride,
               scale + n * G, out);
      for (int r = 0; r < R; r++)
        for (int f = 0; f < F; f++) {
          int64_t row = m + r, feat = n + f;
          float v = out[r * F + f];
          if (k_odd >= 0)
            v += tail16(qx + row * K + k_odd, dx[row * G + G - 1],
                        (const int8_t*)codes + feat * K + k_odd, scale[feat * G + G - 1]);
          v += zero_term(zero + feat * G, xsum + row * G, G);
          y[row * N + feat] = v + (bias ? bias[feat] : 0.0f);
        }
      n += F;
    }
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias) with x quantized per group (module comment). Threads split
// the blocks of output features (OpenMP, as sgl_qlinear_into). Returns -1 if out of memory.
AVX2 int sgl_q8_linear(int bits, int gs, const float* x, int64_t M, int64_t K, const void* codes,
                       const float* scale, const float* zero, int64_t N, const float* bias,
                       float* y, int threads) {
  int64_t G = K / gs;
  int8_t* qx = (int8_t*)malloc((size_t)(M * K > 0 ? M * K : 1));
  float* dx = (float*)malloc(sizeof(float) * (size_t)(M * G > 0 ? 2 * M * G : 2));
  if (qx == NULL || dx == NULL) {
    free(qx);
    free(dx);
    return -1;
  }
  float* xsum = dx + M * G;
  sgl_q8_quantize(x, M, K, gs, qx, dx, xsum, threads);
  int64_t blocks = sgl_qlinear_blocks(N);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t blk = 0; blk < blocks; blk++)
    sgl_q8_block(bits, gs, qx, dx, xsum, M, K, codes, scale, zero, N, bias, y, blk);
  free(qx);
  free(dx);
  return 0;
}
