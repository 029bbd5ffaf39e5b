// sgl's fused CPU ops for one decode step (float32, AVX2 + FMA), beside the quantized linear
// of cpu_kernel.c and compiled into the same library (cpu_kernel.py). Each replaces a chain of
// small torch ops (5-15 dispatches of ~3-10 us each at decode sizes) with one call:
//
//   sgl_rmsnorm       (x [+ r]) -> normed, and the sum              (RMSNorm, fused residual add)
//   sgl_silu_mul      [T, 2I] gate|up -> [T, I] silu(gate) * up
//   sgl_rope          rotate-half RoPE of T rows of `heads` heads, in place
//   sgl_kv_store      k, v rows -> their pool slots (rounded to the pool's element, if narrower)
//   sgl_decode_attn   one query row per request against its KV, read in place from the pool
//                     through the request's row of req_to_token (no gather, no padded copy)
//
// The KV pool holds float32, float16, bfloat16 or float8 e4m3 (`kind`, KV_*): the store rounds
// to nearest even as torch's `.to()` does (F16C for float16; e4m3 saturates at +-448 first),
// and attention widens each element back to float32 as it reads it (exact for every format),
// so all arithmetic stays float32.
//
// Every op has the torch reference it is tested against (tests/test_quant_cpu_ops.py).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

// e^x for 8 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes'
// coefficients), 2^n built in the exponent bits. Relative error ~1e-7; inputs are clamped to
// [-87.3, 88.3], the range where 2^n stays a normal float. The constants are shared with
// exp16, which does the same operations on 16 lanes (the same bits lane for lane).
#define EXP_MIN -87.3f
#define EXP_MAX 88.3f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f  // ln2 in two parts
#define EXP_LN2_LO -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

AVX2 INLINE __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)), _mm256_set1_ps(EXP_MAX));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// out = rmsnorm(x + r) (r may be NULL: rmsnorm(x)); with r, sum = x + r is written too (it may
// alias r: each element is read before it is written). Rows of H floats, contiguous.
AVX2 void sgl_rmsnorm(const float* x, const float* r, const float* w, float eps, int64_t T,
                      int64_t H, float* out, float* sum) {
  for (int64_t t = 0; t < T; t++) {
    const float* xt = x + t * H;
    float* ot = out + t * H;
    const float* src = xt;
    if (r != NULL) {
      const float* rt = r + t * H;
      float* st = sum + t * H;
      for (int64_t i = 0; i < H; i++) st[i] = xt[i] + rt[i];
      src = st;
    }
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) {
      __m256 v = _mm256_loadu_ps(src + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; i < H; i++) ss += src[i] * src[i];
    float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (i = 0; i < H; i++) ot[i] = (src[i] * inv) * w[i];
  }
}

// out [T, I] = silu(x[:, :I]) * x[:, I:], x rows of 2I floats.
AVX2 void sgl_silu_mul(const float* x, int64_t T, int64_t I, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t t = 0; t < T; t++) {
    const float* g = x + t * 2 * I;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      __m256 gv = _mm256_loadu_ps(g + i);
      __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}

// x: T rows (stride `row_stride` floats) of `heads` heads of D floats, rotated in place by
// the cos|sin row of each token's position: cache [P, 2 * half] (cos then sin), rotating the
// first 2 * half features of each head (x1 = [0, half), x2 = [half, 2 half)).
void sgl_rope(float* x, int64_t T, int64_t row_stride, int64_t heads, int64_t D,
              const int64_t* positions, const float* cache, int64_t half) {
  for (int64_t t = 0; t < T; t++) {
    const float* cs = cache + positions[t] * 2 * half;
    const float* sn = cs + half;
    for (int64_t h = 0; h < heads; h++) {
      float* x1 = x + t * row_stride + h * D;
      float* x2 = x1 + half;
      for (int64_t i = 0; i < half; i++) {  // (auto-vectorized: no aliasing inside a head)
        float a = x1[i], b = x2[i];
        x1[i] = a * cs[i] - b * sn[i];
        x2[i] = b * cs[i] + a * sn[i];
      }
    }
  }
}

// The pool's element kinds (cpu_ops.py's _KV_KINDS).
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_E4M3 = 3 };

// Bytes of one pool element.
INLINE int64_t kv_esize(int kind) { return kind == KV_F32 ? 4 : kind == KV_E4M3 ? 1 : 2; }

// F16C for the float16 and e4m3 conversions: every AVX2 CPU has it (cpu_ops.py checks before
// it hands such a pool here); float32 and bfloat16 pools never execute an F16C instruction.
#define KV AVX2  // (the same target: avx2, fma, f16c)

// float32 -> bfloat16 bits, rounded to nearest even; a NaN becomes torch's quiet NaN 0x7FC0.
INLINE uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float32 -> float8 e4m3fn bits (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no
// infinities), rounded to nearest even after saturating to +-448, the largest finite value:
// torch's `x.clamp(-448, 448).to(torch.float8_e4m3fn)`. NaN stays NaN (0x7F with its sign).
INLINE uint8_t to_e4m3(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;
  if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448, infinity included
  if (a >= 0x3c800000u) {  // >= 2^-6, the smallest normal: keep 3 of the 23 mantissa bits
    const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);  // a carry moves into the exponent
    return sign | (uint8_t)((r >> 20) - (120u << 3));  // exponent bias 127 -> 7
  }
  // Subnormal: a multiple of 2^-9, the mantissa (with its hidden bit) shifted into those
  // units, rounded to nearest even; a result of 8 is 2^-6, the first normal code.
  const int exp = (int)(a >> 23);  // 0 for float32 zeros and subnormals: they round to 0
  const int shift = 14 - (exp - 127);  // value = m * 2^(exp - 150), in units of 2^-9
  if (exp == 0 || shift > 24) return sign;
  const uint32_t m = (a & 0x7fffffu) | 0x800000u, half = 1u << (shift - 1);
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((half << 1) - 1u);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return sign | (uint8_t)q;
}

// 8 e4m3 codes, sign-extended to 16 bits -> the float16 bits of code value / 256: shifted left
// by 7, exponent and mantissa land in float16's fields (its exponent bias is 8 more; e4m3
// subnormals land on float16 subnormals) and the sign on bit 15; the mask clears the copy of
// the sign left on bit 14. Widening and multiplying by 256 is then exact.
#define E4M3_F16_MASK ((short)0xbf80)
KV INLINE __m128i e4m3_as_f16(__m128i codes) {
  return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(codes), 7), _mm_set1_epi16(E4M3_F16_MASK));
}

// W floats -> W pool elements of `kind` at dst.
KV INLINE void store_row(void* dst, const float* src, int64_t W, int kind) {
  if (kind == KV_F32) {
    memcpy(dst, src, sizeof(float) * (size_t)W);
  } else if (kind == KV_F16) {
    uint16_t* d = (uint16_t*)dst;
    int64_t i = 0;
    for (; i + 8 <= W; i += 8)
      _mm_storeu_si128((__m128i*)(d + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < W; i++) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
  } else if (kind == KV_E4M3) {
    uint8_t* d = (uint8_t*)dst;
    for (int64_t i = 0; i < W; i++) d[i] = to_e4m3(src[i]);
  } else {
    uint16_t* d = (uint16_t*)dst;
    for (int64_t i = 0; i < W; i++) d[i] = to_bf16(src[i]);
  }
}

// 8 pool elements from element index i, as floats (exact).
KV INLINE __m256 kv_load8(const void* base, int64_t i, int kind) {
  if (kind == KV_F16)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + i)));
  if (kind == KV_BF16) {
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if (kind == KV_E4M3) {
    __m128i codes = _mm_loadl_epi64((const __m128i*)((const uint8_t*)base + i));
    return _mm256_mul_ps(_mm256_cvtph_ps(e4m3_as_f16(codes)), _mm256_set1_ps(256.0f));
  }
  return _mm256_loadu_ps((const float*)base + i);
}

KV INLINE float kv_load1(const void* base, int64_t i, int kind) {
  if (kind == KV_F16) return _cvtsh_ss(((const uint16_t*)base)[i]);
  if (kind == KV_BF16) {
    uint32_t u = (uint32_t)((const uint16_t*)base)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  if (kind == KV_E4M3) {
    uint16_t c = (uint16_t)((const int8_t*)base)[i];  // sign-extended
    return _cvtsh_ss((unsigned short)((c << 7) & (uint16_t)E4M3_F16_MASK)) * 256.0f;
  }
  return ((const float*)base)[i];
}

// Asks for the cache lines of the D pool elements at element index i. A request's keys and
// values sit wherever its slots are (decode steps interleave the batch's requests, freed slots
// are reused), an order the hardware prefetcher does not follow.
INLINE void kv_prefetch(const void* base, int64_t i, int64_t D, int kind) {
  const int64_t esize = kv_esize(kind);
  const char* p = (const char*)base + i * esize;
  for (int64_t b = 0; b < D * esize; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// How many keys ahead the loops below ask for a key's or a value's row.
#define KV_AHEAD 16

// k, v: T rows of W floats (strides k_stride, v_stride) -> rows loc[t] of the pool buffers
// [slots, W] of element `kind`.
KV void sgl_kv_store(void* kbuf, void* vbuf, const float* k, int64_t k_stride, const float* v,
                     int64_t v_stride, const int64_t* loc, int64_t T, int64_t W, int kind) {
  size_t esize = (size_t)kv_esize(kind);
  for (int64_t t = 0; t < T; t++) {
    store_row((char*)kbuf + (size_t)(loc[t] * W) * esize, k + t * k_stride, W, kind);
    store_row((char*)vbuf + (size_t)(loc[t] * W) * esize, v + t * v_stride, W, kind);
  }
}

// q . K[i .. i + D) in dot order: 8-wide FMA chain, then the scalar tail.
KV INLINE float dot_kv(const float* q, const void* kbuf, int64_t i0, int64_t D, int kind) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load8(kbuf, i0 + i, kind), acc);
  float s = hsum8(acc);
  for (; i < D; i++) s += q[i] * kv_load1(kbuf, i0 + i, kind);
  return s;
}

// softmax of n scores in place; returns nothing (the scores become probabilities).
// The max is taken 8 lanes at a time (a scalar compare chain was ~15% of a decode row's
// attention): a max is exact in any order, and a NaN score is skipped either way (maxps
// returns its second operand, the running max, where one is NaN). Only the sign of a zero max
// can differ from a scalar scan's, and s - (+0) and s - (-0) have the same exp.
AVX2 INLINE void softmax(float* s, int64_t n) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(s + j), mv);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float mx = _mm_cvtss_f32(m4);
  for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
  __m256 m8 = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum8(acc);
  for (; j < n; j++) total += (s[j] = expf(s[j] - mx));
  float inv = 1.0f / total;
  for (j = 0; j < n; j++) s[j] *= inv;
}

// A KV head's keys and values are read once for all of its query heads: GN <= 4 heads (a
// constant at each call) side by side, each head's arithmetic exactly that of a head alone.
// Scores of GN query heads (q [GN, D]) against keys [0, len) into scores[g * ls + j]: two keys
// at a time, each score an 8-wide FMA chain over D then hsum8, times scale (dot_kv's order).
KV INLINE void scores_heads(const float* q, const void* kbuf, const int32_t* row, int64_t stride,
                            int64_t off, int64_t len, int64_t D, float scale, float* scores,
                            int64_t ls, const int GN, int kind) {
  int64_t j = 0;
  for (; j + 2 <= len; j += 2) {
    int64_t k0 = (int64_t)row[j] * stride + off, k1 = (int64_t)row[j + 1] * stride + off;
    for (int64_t t = j + KV_AHEAD; t < j + KV_AHEAD + 2 && t < len; t++)
      kv_prefetch(kbuf, (int64_t)row[t] * stride + off, D, kind);
    __m256 a[4][2];
    for (int g = 0; g < GN; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      __m256 kv0 = kv_load8(kbuf, k0 + i, kind), kv1 = kv_load8(kbuf, k1 + i, kind);
      for (int g = 0; g < GN; g++) {
        __m256 qv = _mm256_loadu_ps(q + g * D + i);
        a[g][0] = _mm256_fmadd_ps(qv, kv0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(qv, kv1, a[g][1]);
      }
    }
    for (int g = 0; g < GN; g++) {
      scores[g * ls + j] = hsum8(a[g][0]) * scale;
      scores[g * ls + j + 1] = hsum8(a[g][1]) * scale;
    }
  }
  for (; j < len; j++)
    for (int g = 0; g < GN; g++)
      scores[g * ls + j] = dot_kv(q + g * D, kbuf, (int64_t)row[j] * stride + off, D, kind) * scale;
}

// out[g * D + i] = sum over j of p[g * ls + j] * V_j[i] for GN heads, each element summed in key
// order (as an axpy per key would). CH vectors of 8 per pass over the keys, GN * CH
// accumulators held in registers (AVX2's 16 with the broadcasts and the value loaded).
KV INLINE void weighted_sum_heads(const float* p, int64_t ls, int64_t len, const void* vbuf,
                                  const int32_t* row, int64_t stride, int64_t off, int64_t D,
                                  float* out, const int GN, int kind) {
  const int CH = GN == 1 ? 8 : GN == 2 ? 4 : 2;
  for (int64_t c0 = 0; c0 < D; c0 += 8 * CH) {
    const int n = D - c0 < 8 * CH ? (int)((D - c0) / 8) : CH;
    __m256 a[4][8];
    for (int g = 0; g < GN; g++)
      for (int c = 0; c < CH; c++) a[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j++) {
      int64_t vi = (int64_t)row[j] * stride + off + c0;
      if (c0 == 0 && j + KV_AHEAD < len)
        kv_prefetch(vbuf, (int64_t)row[j + KV_AHEAD] * stride + off, D, kind);
      __m256 pj[4];
      for (int g = 0; g < GN; g++) pj[g] = _mm256_set1_ps(p[g * ls + j]);
      for (int c = 0; c < CH; c++) {
        if (c >= n) break;
        __m256 v = kv_load8(vbuf, vi + 8 * c, kind);
        for (int g = 0; g < GN; g++) a[g][c] = _mm256_fmadd_ps(pj[g], v, a[g][c]);
      }
    }
    for (int g = 0; g < GN; g++)
      for (int c = 0; c < n; c++) _mm256_storeu_ps(out + g * D + c0 + 8 * c, a[g][c]);
  }
}

#define HEADS_CASES(CALL)                                              \
  switch (gn) {                                                        \
    case 1: CALL(1); break; case 2: CALL(2); break;                    \
    case 3: CALL(3); break; default: CALL(4); break; }

// One (request, KV head) task with D a multiple of 8: the same arithmetic as attend_one (bit
// for bit), reordered for the core: the G query heads in groups of up to four that share each
// key's and value's load and widening, two keys at a time, the output held in registers.
KV INLINE void attend_one8(const float* q, float* out, int64_t G, int64_t kvh, int64_t h,
                           int64_t D, const void* kbuf, const void* vbuf, const int32_t* row,
                           int64_t len, float scale, float* scores, int kind) {
  const int64_t stride = kvh * D, off = h * D;
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int gn = G - g0 < 4 ? (int)(G - g0) : 4;
#define SCORES(GN) scores_heads(q + g0 * D, kbuf, row, stride, off, len, D, scale, \
                                scores + g0 * len, len, GN, kind)
    HEADS_CASES(SCORES)
#undef SCORES
  }
  for (int64_t j = 0; j < KV_AHEAD && j < len; j++)  // (the first values, while softmax runs)
    kv_prefetch(vbuf, (int64_t)row[j] * stride + off, D, kind);
  for (int64_t g = 0; g < G; g++) softmax(scores + g * len, len);
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int gn = G - g0 < 4 ? (int)(G - g0) : 4;
#define SUMS(GN) weighted_sum_heads(scores + g0 * len, len, len, vbuf, row, stride, off, D, \
                                    out + g0 * D, GN, kind)
    HEADS_CASES(SUMS)
#undef SUMS
  }
}

#if SGL_X86
// ---- The AVX-512 twin of attend_one8 for D a multiple of 16: the same bits, fewer instructions.
// Scores: two keys share a 16-lane accumulator (lanes 0-7 the first key's 8-wide chain over D,
// lanes 8-15 the second's), and 16 keys' chains are summed as hsum8 sums one chain (lanes l and
// l + 4, then the pairs left, then the last two) on vectors holding several keys at once,
// instead of one horizontal sum per key and head. Values: one pass of 16-lane chunks per key.

// 16 e4m3 codes as floats (exact): e4m3_as_f16 on 16 lanes.
AVX512 INLINE __m512 e4m3x16(__m128i codes) {
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7),
                               _mm256_set1_epi16(E4M3_F16_MASK));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

// [K at element i0, 8 elements | K at i1, 8 elements] as 16 floats (exact).
AVX512 INLINE __m512 kv_load8x2(const void* base, int64_t i0, int64_t i1, int kind) {
  if (kind == KV_F32) {
    const float* f = (const float*)base;
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(f + i0)),
                              _mm256_loadu_ps(f + i1), 1);
  }
  if (kind == KV_E4M3) {
    const uint8_t* b = (const uint8_t*)base;
    __m128i w = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(b + i0)),
                                   _mm_loadl_epi64((const __m128i*)(b + i1)));
    return e4m3x16(w);
  }
  const uint16_t* h = (const uint16_t*)base;
  __m256i two = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(h + i0))),
                                        _mm_loadu_si128((const __m128i*)(h + i1)), 1);
  if (kind == KV_F16) return _mm512_cvtph_ps(two);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(two), 16));
}

// 16 pool elements from element index i, as floats (exact).
AVX512 INLINE __m512 kv_load16(const void* base, int64_t i, int kind) {
  if (kind == KV_F32) return _mm512_loadu_ps((const float*)base + i);
  if (kind == KV_E4M3) return e4m3x16(_mm_loadu_si128((const __m128i*)((const uint8_t*)base + i)));
  __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i));
  if (kind == KV_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// hsum8's first two steps on 4 pair accumulators (8 keys): lane block m of the result is
// [s(m)_0, s(m)_1, s(4 + m)_0, s(4 + m)_1], s(k)_0 = (v0 + v4) + (v2 + v6) and s(k)_1 =
// (v1 + v5) + (v3 + v7) of key k's chain v.
AVX512 INLINE __m512 halve8keys(const __m512 a[4]) {
  // blocks [k0, k1, k2, k3] and [k4, k5, k6, k7], each lane l = v_l + v_(l+4) (the shuffles'
  // selectors literal constants: clang takes no other)
#define LO _MM_SHUFFLE(2, 0, 2, 0)
#define HI _MM_SHUFFLE(3, 1, 3, 1)
  __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], LO), _mm512_shuffle_f32x4(a[0], a[1], HI));
  __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], LO), _mm512_shuffle_f32x4(a[2], a[3], HI));
#undef LO
#undef HI
  return _mm512_add_ps(_mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Scores of GN heads against the 16 keys at element offsets k[0..16): hsum8(chain) * scale each;
// mx[g] takes their max (softmax16's, lane by lane; NaN scores skipped as softmax skips them).
AVX512 INLINE void scores16_heads(const float* q, const void* kbuf, const int64_t k[16], int64_t D,
                                  float scale, float* scores, int64_t ls, __m512 mx[4],
                                  const int GN, int kind) {
  __m512 half[2][4];
  for (int h = 0; h < 2; h++) {
    __m512 a[4][4];
    for (int g = 0; g < GN; g++)
      for (int p = 0; p < 4; p++) a[g][p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      __m512 kv[4];
      for (int p = 0; p < 4; p++) kv[p] = kv_load8x2(kbuf, k[8 * h + 2 * p] + i, k[8 * h + 2 * p + 1] + i, kind);
      for (int g = 0; g < GN; g++) {
        __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * D + i));
        for (int p = 0; p < 4; p++) a[g][p] = _mm512_fmadd_ps(qv, kv[p], a[g][p]);
      }
    }
    for (int g = 0; g < GN; g++) half[h][g] = halve8keys(a[g]);
  }
  // lane 4m + t of the last sum is key 4t + m: permuted back to key order
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < GN; g++) {
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(half[0][g], half[1][g], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(half[0][g], half[1][g], _MM_SHUFFLE(3, 1, 3, 1)));
    s = _mm512_mul_ps(_mm512_permutexvar_ps(order, s), sc);
    _mm512_storeu_ps(scores + g * ls, s);
    mx[g] = _mm512_max_ps(s, mx[g]);
  }
}

// exp8 on 16 lanes: each lane the same operations, so the same bits as exp8's lane.
AVX512 INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)), _mm512_set1_ps(EXP_MAX));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)),
                                23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// softmax of n scores whose max is mx (the scores pass took it): softmax's bits, 16 lanes at a
// time. The sum of the exps keeps softmax's 8-lane order (elements j .. j + 7 added before
// j + 8 .. j + 15), so only the exps and the last scaling are wider.
AVX512 INLINE void softmax16(float* s, int64_t n, float mx) {
  const __m512 m16 = _mm512_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m16));
    _mm512_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm512_extractf32x8_ps(e, 1));
  }
  if (j + 8 <= n) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm512_castps512_ps256(m16)));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
    j += 8;
  }
  float total = hsum8(acc);
  for (; j < n; j++) total += (s[j] = expf(s[j] - mx));
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (j = 0; j + 16 <= n; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
  if (j < n) {
    const __mmask16 m = (__mmask16)((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv));
  }
}

// NC 16-lane chunks of the weighted sum from element c0 of each value row (weighted_sum16_heads).
// NC and GN are constants at each call: no per-key branch on the chunk count.
AVX512 INLINE void wsum16_chunks(const float* p, int64_t ls, int64_t len, const void* vbuf,
                                 const int32_t* row, int64_t stride, int64_t off, int64_t D,
                                 int64_t c0, float* out, const int GN, const int NC, int kind) {
  __m512 a[4][8];
  for (int g = 0; g < GN; g++)
    for (int c = 0; c < NC; c++) a[g][c] = _mm512_setzero_ps();
  // (the rows KV_AHEAD keys on are asked for by the first pass over the chunks only)
  const int64_t ahead = c0 == 0 ? len - KV_AHEAD : 0;
  for (int64_t j = 0; j < len; j++) {
    const int64_t vi = (int64_t)row[j] * stride + off + c0;
    if (j < ahead) kv_prefetch(vbuf, (int64_t)row[j + KV_AHEAD] * stride + off, D, kind);
    __m512 pj[4];
    for (int g = 0; g < GN; g++) pj[g] = _mm512_set1_ps(p[g * ls + j]);
    for (int c = 0; c < NC; c++) {
      __m512 v = kv_load16(vbuf, vi + 16 * c, kind);
      for (int g = 0; g < GN; g++) a[g][c] = _mm512_fmadd_ps(pj[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < GN; g++)
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + g * D + c0 + 16 * c, a[g][c]);
}

// weighted_sum_heads on 16-lane chunks (D a multiple of 16): each element summed in key order,
// whatever the chunks (CH chunks per pass over the keys, GN * CH accumulators in registers).
AVX512 INLINE void weighted_sum16_heads(const float* p, int64_t ls, int64_t len, const void* vbuf,
                                        const int32_t* row, int64_t stride, int64_t off, int64_t D,
                                        float* out, const int GN, int kind) {
  const int CH = GN == 1 ? 8 : 4;
  for (int64_t c0 = 0; c0 < D; c0 += 16 * CH) {
    const int64_t n = D - c0 < 16 * CH ? (D - c0) / 16 : CH;
#define WSUM(NC) wsum16_chunks(p, ls, len, vbuf, row, stride, off, D, c0, out, GN, NC, kind)
    switch (n) {
      case 1: WSUM(1); break; case 2: WSUM(2); break; case 3: WSUM(3); break;
      case 4: WSUM(4); break; case 5: WSUM(5); break; case 6: WSUM(6); break;
      case 7: WSUM(7); break; default: WSUM(8); break;
    }
#undef WSUM
  }
}

AVX512 INLINE void attend_heads16(const float* q, float* out, int64_t G, int64_t stride, int64_t off,
                                  int64_t D, const void* kbuf, const void* vbuf,
                                  const int32_t* row, int64_t len, float scale, float* scores,
                                  int kind) {
  const int64_t full = len / 16 * 16;
  float* maxes = scores + G * len;  // [G]: each head's max score (the work buffer's [G, D] part)
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int gn = G - g0 < 4 ? (int)(G - g0) : 4;
    __m512 mx[4];
    for (int g = 0; g < 4; g++) mx[g] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < full; j += 16) {
      int64_t k[16];
      for (int t = 0; t < 16; t++) k[t] = (int64_t)row[j + t] * stride + off;
      for (int64_t t = j + 16; t < j + 32 && t < len; t++)  // (the next block's keys)
        kv_prefetch(kbuf, (int64_t)row[t] * stride + off, D, kind);
#define SCORES16(GN) scores16_heads(q + g0 * D, kbuf, k, D, scale, scores + g0 * len + j, len, mx, \
                                    GN, kind)
      HEADS_CASES(SCORES16)
#undef SCORES16
    }
    if (full < len) {  // the last keys as attend_one8 scores them (the same bits)
#define SCORES(GN) scores_heads(q + g0 * D, kbuf, row + full, stride, off, len - full, D, scale, \
                                scores + g0 * len + full, len, GN, kind)
      HEADS_CASES(SCORES)
#undef SCORES
    }
    for (int g = 0; g < gn; g++) {
      float m = _mm512_reduce_max_ps(mx[g]);  // (exact: a max in any order)
      const float* sg = scores + (g0 + g) * len;
      for (int64_t j = full; j < len; j++) m = sg[j] > m ? sg[j] : m;
      maxes[g0 + g] = m;
    }
  }
  for (int64_t j = 0; j < KV_AHEAD && j < len; j++)  // (the first values, while softmax runs)
    kv_prefetch(vbuf, (int64_t)row[j] * stride + off, D, kind);
  for (int64_t g = 0; g < G; g++) softmax16(scores + g * len, len, maxes[g]);
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int gn = G - g0 < 4 ? (int)(G - g0) : 4;
#define SUMS16(GN) weighted_sum16_heads(scores + g0 * len, len, len, vbuf, row, stride, off, D, \
                                        out + g0 * D, GN, kind)
    HEADS_CASES(SUMS16)
#undef SUMS16
  }
}

// attend_one8 where D % 16 == 0 and the AVX-512 twins are on (a function of its own: AVX-512
// code is never inlined into the AVX2 callers).
AVX512 static void attend_one_512(const float* q, float* out, int64_t G, int64_t kvh, int64_t h,
                                  int64_t D, const void* kbuf, const void* vbuf, const int32_t* row,
                                  int64_t len, float scale, float* scores, int kind) {
  const int64_t stride = kvh * D, off = h * D;
  if (kind == KV_F16)
    attend_heads16(q, out, G, stride, off, D, kbuf, vbuf, row, len, scale, scores, KV_F16);
  else if (kind == KV_BF16)
    attend_heads16(q, out, G, stride, off, D, kbuf, vbuf, row, len, scale, scores, KV_BF16);
  else if (kind == KV_E4M3)
    attend_heads16(q, out, G, stride, off, D, kbuf, vbuf, row, len, scale, scores, KV_E4M3);
  else
    attend_heads16(q, out, G, stride, off, D, kbuf, vbuf, row, len, scale, scores, KV_F32);
}
#else  // (no AVX-512 twins off x86-64: sgl_avx512_on() is 0 there, so this is never called)
#define attend_one_512(...) abort()
#endif

// One (request, KV head) task: the G = heads / kv_heads query heads that share KV head h.
KV INLINE void attend_one(const float* q, float* out, int64_t G, int64_t kvh, int64_t h,
                          int64_t D, const void* kbuf, const void* vbuf, const int32_t* row,
                          int64_t len, float scale, float* work, int kind) {
  float* scores = work;        // [G, len]
  float* acc = work + G * len;  // [G, D]
  for (int64_t j = 0; j < len; j++) {
    int64_t ki = ((int64_t)row[j] * kvh + h) * D;
    for (int64_t g = 0; g < G; g++)
      scores[g * len + j] = dot_kv(q + g * D, kbuf, ki, D, kind) * scale;
  }
  for (int64_t g = 0; g < G; g++) softmax(scores + g * len, len);
  memset(acc, 0, sizeof(float) * (size_t)(G * D));
  for (int64_t j = 0; j < len; j++) {
    int64_t vi = ((int64_t)row[j] * kvh + h) * D;
    for (int64_t g = 0; g < G; g++) {
      float pj = scores[g * len + j];
      __m256 p = _mm256_set1_ps(pj);
      float* a = acc + g * D;
      int64_t i = 0;
      for (; i + 8 <= D; i += 8)
        _mm256_storeu_ps(
            a + i, _mm256_fmadd_ps(p, kv_load8(vbuf, vi + i, kind), _mm256_loadu_ps(a + i)));
      for (; i < D; i++) a[i] += pj * kv_load1(vbuf, vi + i, kind);
    }
  }
  memcpy(out, acc, sizeof(float) * (size_t)(G * D));
}

// One task, specialized per element kind (the kind a compile-time constant in each call).
KV INLINE void attend_task(const float* q, float* out, int64_t G, int64_t kvh, int64_t h,
                           int64_t D, const void* kbuf, const void* vbuf, const int32_t* row,
                           int64_t len, float scale, float* work, int kind) {
  if (D % 16 == 0 && sgl_avx512_on()) {
    attend_one_512(q, out, G, kvh, h, D, kbuf, vbuf, row, len, scale, work, kind);
    return;
  }
#define SGL_ATTEND(K)                                                                 \
  if (D % 8 == 0)                                                                     \
    attend_one8(q, out, G, kvh, h, D, kbuf, vbuf, row, len, scale, work, K);          \
  else                                                                                \
    attend_one(q, out, G, kvh, h, D, kbuf, vbuf, row, len, scale, work, K);
  if (kind == KV_F16) {
    SGL_ATTEND(KV_F16)
  } else if (kind == KV_BF16) {
    SGL_ATTEND(KV_BF16)
  } else if (kind == KV_E4M3) {
    SGL_ATTEND(KV_E4M3)
  } else {
    SGL_ATTEND(KV_F32)
  }
#undef SGL_ATTEND
}

// Query heads [hq, hq + n) of request b, within one KV head's group: a task of sgl_decode_attn
// (n = heads / kvh) or a part of one; the unit the decode step's team (cpu_layer.c) shares a
// step's attention in. Every score, softmax and output sum is per query head, so the bits do
// not depend on how heads are grouped. work: at least n * (lens[b] + D) floats. Arguments as
// sgl_decode_attn's.
KV void sgl_decode_attn_heads(const float* q, int64_t q_stride, int64_t b, int64_t hq, int64_t n,
                              int64_t heads, int64_t kvh, int64_t D, const void* kbuf,
                              const void* vbuf, const int32_t* table, int64_t table_stride,
                              const int64_t* table_rows, const int64_t* lens, float scale,
                              float* out, int kind, float* work) {
  attend_task(q + b * q_stride + hq * D, out + (b * heads + hq) * D, n, kvh, hq / (heads / kvh),
              D, kbuf, vbuf, table + table_rows[b] * table_stride, lens[b], scale, work, kind);
}

// Decode attention of B requests, one query row each.
//   q: rows q_rows[b] (or b when q_rows is NULL), stride q_stride floats, [heads, D] each;
//   out: the same rows of a [*, heads, D] contiguous tensor;
//   KV of request b: positions [0, lens[b]) at slots table[table_rows[b] * table_stride + j]
//   of the pool buffers [slots, kv_heads, D] of element `kind`.
// Returns 0, or -1 when a work buffer could not be allocated.
KV int sgl_decode_attn(const float* q, int64_t q_stride, const int64_t* q_rows, int64_t B,
                       int64_t heads, int64_t kvh, int64_t D, const void* kbuf,
                       const void* vbuf, const int32_t* table, int64_t table_stride,
                       const int64_t* table_rows, const int64_t* lens, float scale, float* out,
                       int threads, int kind) {
  int64_t G = heads / kvh, max_len = 0, total = 0;
  for (int64_t b = 0; b < B; b++) {
    max_len = lens[b] > max_len ? lens[b] : max_len;
    total += lens[b];
  }
  int failed = 0;
  // Small steps run on the calling thread: a parallel region costs more than it saves.
  int use = total * heads * D < (1 << 16) ? 1 : threads;
#pragma omp parallel num_threads(use)
  {
    float* work = (float*)malloc(sizeof(float) * (size_t)(G * (max_len + D)));
    if (work == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * kvh; task++) {
      if (work == NULL) continue;
      int64_t b = task / kvh, h = task % kvh;
      int64_t qr = q_rows ? q_rows[b] : b;
      attend_task(q + qr * q_stride + h * G * D, out + (qr * heads + h * G) * D, G, kvh, h, D,
                  kbuf, vbuf, table + table_rows[b] * table_stride, lens[b], scale, work, kind);
    }
    free(work);
  }
  return failed ? -1 : 0;
}
