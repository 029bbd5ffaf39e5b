// The AVX2, FMA and F16C intrinsics sgl's CPU C files use, written in portable C (GCC and
// clang vector extensions), for CPUs that are not x86-64 (an ARM laptop) and for the tests,
// which build the library this way on x86 too (SGL_PORTABLE) and compare its bits with the
// AVX2 build's. cpu_simd.h includes this instead of <immintrin.h> there.
//
// Each function computes what the instruction computes, lane by lane, with the same IEEE
// float32 operations (one rounding per add, multiply or divide; one for a fused multiply-add:
// fmaf; the library is built with -ffp-contract=off, so nothing else is fused), the same
// integer wrap-around and saturation, and x86's answers where the instruction defines one
// (max/min of a NaN: the second operand; float to int32 out of range: INT32_MIN). So a kernel
// built on these gives the bits of its AVX2 build. Only what the kernels call is here; the
// compiler turns the lane loops into the target's vector instructions (NEON on ARM).
#ifndef SGL_CPU_PORTABLE_H
#define SGL_CPU_PORTABLE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#pragma GCC diagnostic ignored "-Wpsabi"  // (32-byte vectors without AVX on x86: all inline)

typedef float __m256 __attribute__((vector_size(32)));
typedef float __m128 __attribute__((vector_size(16)));
typedef long long __m256i __attribute__((vector_size(32)));
typedef long long __m128i __attribute__((vector_size(16)));
typedef int32_t sgl_i32x8 __attribute__((vector_size(32)));
typedef int16_t sgl_i16x16 __attribute__((vector_size(32)));
typedef int8_t sgl_i8x32 __attribute__((vector_size(32)));
typedef uint8_t sgl_u8x32 __attribute__((vector_size(32)));
typedef int32_t sgl_i32x4 __attribute__((vector_size(16)));
typedef int16_t sgl_i16x8 __attribute__((vector_size(16)));
typedef int8_t sgl_i8x16 __attribute__((vector_size(16)));
typedef uint8_t sgl_u8x16 __attribute__((vector_size(16)));
typedef uint16_t sgl_u16x8 __attribute__((vector_size(16)));
typedef uint32_t sgl_u32x8 __attribute__((vector_size(32)));
typedef uint16_t sgl_u16x16 __attribute__((vector_size(32)));

#define PORTABLE static inline __attribute__((always_inline))
#define _MM_SHUFFLE(a, b, c, d) (((a) << 6) | ((b) << 4) | ((c) << 2) | (d))
#define _MM_HINT_T0 3
#define _MM_FROUND_TO_NEAREST_INT 0
#define _MM_FROUND_NO_EXC 8

// ---- loads, stores, constants
PORTABLE __m256 _mm256_loadu_ps(const float* p) { __m256 v; memcpy(&v, p, 32); return v; }
PORTABLE void _mm256_storeu_ps(float* p, __m256 v) { memcpy(p, &v, 32); }
PORTABLE __m256i _mm256_loadu_si256(const __m256i* p) { __m256i v; memcpy(&v, p, 32); return v; }
PORTABLE __m128i _mm_loadu_si128(const __m128i* p) { __m128i v; memcpy(&v, p, 16); return v; }
PORTABLE void _mm_storeu_si128(__m128i* p, __m128i v) { memcpy(p, &v, 16); }
PORTABLE __m128i _mm_loadl_epi64(const __m128i* p) {  // the low 8 bytes; the rest zero
  __m128i v = {0, 0};
  memcpy(&v, p, 8);
  return v;
}
PORTABLE __m256 _mm256_set1_ps(float a) { return (__m256){a, a, a, a, a, a, a, a}; }
PORTABLE __m256 _mm256_setzero_ps(void) { return _mm256_set1_ps(0.0f); }
PORTABLE __m256 _mm256_broadcast_ss(const float* p) { return _mm256_set1_ps(*p); }
PORTABLE __m128 _mm_broadcast_ss(const float* p) { return (__m128){*p, *p, *p, *p}; }
PORTABLE __m256i _mm256_set1_epi32(int a) {
  sgl_i32x8 v = {a, a, a, a, a, a, a, a};
  return (__m256i)v;
}
PORTABLE __m256i _mm256_set1_epi16(short a) {
  sgl_i16x16 v;
  for (int i = 0; i < 16; i++) v[i] = a;
  return (__m256i)v;
}
PORTABLE __m256i _mm256_set1_epi8(char a) {
  sgl_i8x32 v;
  for (int i = 0; i < 32; i++) v[i] = (int8_t)a;
  return (__m256i)v;
}
PORTABLE __m128i _mm_set1_epi16(short a) {
  sgl_i16x8 v = {a, a, a, a, a, a, a, a};
  return (__m128i)v;
}
PORTABLE void _mm_prefetch(const void* p, int hint) { (void)hint; __builtin_prefetch(p); }
PORTABLE void _mm_pause(void) {
#if defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// ---- float arithmetic (8 lanes)
PORTABLE __m256 _mm256_add_ps(__m256 a, __m256 b) { return a + b; }
PORTABLE __m256 _mm256_sub_ps(__m256 a, __m256 b) { return a - b; }
PORTABLE __m256 _mm256_mul_ps(__m256 a, __m256 b) { return a * b; }
PORTABLE __m256 _mm256_div_ps(__m256 a, __m256 b) { return a / b; }
PORTABLE __m256 _mm256_fmadd_ps(__m256 a, __m256 b, __m256 c) {
  __m256 r;
  for (int i = 0; i < 8; i++) r[i] = fmaf(a[i], b[i], c[i]);
  return r;
}
PORTABLE __m256 _mm256_fnmadd_ps(__m256 a, __m256 b, __m256 c) {  // c - a b, one rounding
  __m256 r;
  for (int i = 0; i < 8; i++) r[i] = fmaf(-a[i], b[i], c[i]);
  return r;
}
PORTABLE __m256 _mm256_max_ps(__m256 a, __m256 b) {
  __m256 r;
  for (int i = 0; i < 8; i++) r[i] = a[i] > b[i] ? a[i] : b[i];
  return r;
}
PORTABLE __m256 _mm256_min_ps(__m256 a, __m256 b) {
  __m256 r;
  for (int i = 0; i < 8; i++) r[i] = a[i] < b[i] ? a[i] : b[i];
  return r;
}
PORTABLE __m256 _mm256_round_ps(__m256 a, int mode) {  // (sgl asks for nearest, ties to even)
  (void)mode;
  __m256 r;
  for (int i = 0; i < 8; i++) r[i] = nearbyintf(a[i]);
  return r;
}
PORTABLE __m256 _mm256_andnot_ps(__m256 a, __m256 b) { return (__m256)(~(sgl_i32x8)a & (sgl_i32x8)b); }

// ---- float <-> int, float16
PORTABLE __m256 _mm256_cvtepi32_ps(__m256i a) {
  sgl_i32x8 v = (sgl_i32x8)a;
  __m256 r;
  for (int i = 0; i < 8; i++) r[i] = (float)v[i];
  return r;
}
PORTABLE __m256i _mm256_cvtps_epi32(__m256 a) {  // nearest, ties to even; INT32_MIN out of range
  sgl_i32x8 r;
  for (int i = 0; i < 8; i++) {
    float n = nearbyintf(a[i]);
    r[i] = n >= -2147483648.0f && n < 2147483648.0f ? (int32_t)n : INT32_MIN;
  }
  return (__m256i)r;
}
#ifdef __FLT16_MAX__  // the compiler has _Float16 (GCC 12+, clang on ARM): its conversions
PORTABLE float _cvtsh_ss(unsigned short h) {
  _Float16 f;
  memcpy(&f, &h, 2);
  return (float)f;
}
PORTABLE unsigned short _cvtss_sh(float a, int mode) {  // nearest, ties to even
  (void)mode;
  _Float16 f = (_Float16)a;
  unsigned short h;
  memcpy(&h, &f, 2);
  return h;
}
#else  // the same conversions on the bits
PORTABLE float _cvtsh_ss(unsigned short h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);  // inf, NaN (payload kept, as F16C does)
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: exactly man * 2^-24
    float f = (float)man * 5.9604644775390625e-8f;
    memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
PORTABLE unsigned short _cvtss_sh(float a, int mode) {  // nearest, ties to even
  (void)mode;
  uint32_t x;
  memcpy(&x, &a, 4);
  uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
  if (ax >= 0x7F800000)  // inf, NaN (quieted, the payload's top bits kept)
    return (unsigned short)(sign | 0x7C00 | (ax > 0x7F800000 ? 0x200 | ((ax >> 13) & 0x3FF) : 0));
  if (ax >= 0x477FF000) return (unsigned short)(sign | 0x7C00);  // rounds past 65504
  if (ax < 0x38800000) {  // a float16 subnormal or zero: round |a| * 2^24 to an integer
    float m;
    memcpy(&m, &ax, 4);
    return (unsigned short)(sign | (uint32_t)nearbyintf(m * 16777216.0f));
  }
  uint32_t r = ax + 0xFFF + ((ax >> 13) & 1);  // round the 13 dropped bits, ties to even
  return (unsigned short)(sign | ((r - 0x38000000) >> 13));
}
#endif
PORTABLE __m256 _mm256_cvtph_ps(__m128i a) {
  sgl_u16x8 h = (sgl_u16x8)a;
  __m256 r;
  for (int i = 0; i < 8; i++) r[i] = _cvtsh_ss(h[i]);
  return r;
}
PORTABLE __m128i _mm256_cvtps_ph(__m256 a, int mode) {
  sgl_u16x8 h;
  for (int i = 0; i < 8; i++) h[i] = _cvtss_sh(a[i], mode);
  return (__m128i)h;
}

// ---- reinterpretations, halves
PORTABLE __m256 _mm256_castsi256_ps(__m256i a) { return (__m256)a; }
PORTABLE __m128 _mm256_castps256_ps128(__m256 a) { return (__m128){a[0], a[1], a[2], a[3]}; }
PORTABLE __m128 _mm256_extractf128_ps(__m256 a, int hi) {
  return hi ? (__m128){a[4], a[5], a[6], a[7]} : _mm256_castps256_ps128(a);
}
PORTABLE __m128i _mm256_castsi256_si128(__m256i a) { return (__m128i){a[0], a[1]}; }
PORTABLE __m128i _mm256_extracti128_si256(__m256i a, int hi) {
  return hi ? (__m128i){a[2], a[3]} : (__m128i){a[0], a[1]};
}
PORTABLE __m256i _mm256_castsi128_si256(__m128i a) { return (__m256i){a[0], a[1], 0, 0}; }
PORTABLE __m256i _mm256_inserti128_si256(__m256i a, __m128i b, int hi) {
  return hi ? (__m256i){a[0], a[1], b[0], b[1]} : (__m256i){b[0], b[1], a[2], a[3]};
}
PORTABLE __m256 _mm256_set_m128(__m128 hi, __m128 lo) {
  return (__m256){lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]};
}

// ---- 4-lane float (the horizontal sums and maxima)
PORTABLE __m128 _mm_add_ps(__m128 a, __m128 b) { return a + b; }
PORTABLE __m128 _mm_add_ss(__m128 a, __m128 b) { return (__m128){a[0] + b[0], a[1], a[2], a[3]}; }
PORTABLE __m128 _mm_max_ps(__m128 a, __m128 b) {
  __m128 r;
  for (int i = 0; i < 4; i++) r[i] = a[i] > b[i] ? a[i] : b[i];
  return r;
}
PORTABLE __m128 _mm_max_ss(__m128 a, __m128 b) {
  return (__m128){a[0] > b[0] ? a[0] : b[0], a[1], a[2], a[3]};
}
PORTABLE __m128 _mm_movehl_ps(__m128 a, __m128 b) { return (__m128){b[2], b[3], a[2], a[3]}; }
PORTABLE __m128 _mm_movehdup_ps(__m128 a) { return (__m128){a[1], a[1], a[3], a[3]}; }
PORTABLE float _mm_cvtss_f32(__m128 a) { return a[0]; }

// ---- integers (8 x 32, 16 x 16, 32 x 8 bits)
PORTABLE __m256i _mm256_and_si256(__m256i a, __m256i b) { return a & b; }
PORTABLE __m128i _mm_and_si128(__m128i a, __m128i b) { return a & b; }
PORTABLE __m256i _mm256_add_epi32(__m256i a, __m256i b) {
  return (__m256i)((sgl_i32x8)a + (sgl_i32x8)b);  // (vector adds wrap: no UB on overflow)
}
PORTABLE __m256i _mm256_add_epi16(__m256i a, __m256i b) {
  return (__m256i)((sgl_i16x16)a + (sgl_i16x16)b);
}
PORTABLE __m256i _mm256_slli_epi32(__m256i a, int n) {
  return n > 31 ? (__m256i){0, 0, 0, 0} : (__m256i)((sgl_i32x8)a << n);
}
PORTABLE __m256i _mm256_srli_epi32(__m256i a, int n) {
  return n > 31 ? (__m256i){0, 0, 0, 0} : (__m256i)((sgl_u32x8)a >> n);
}
PORTABLE __m256i _mm256_slli_epi16(__m256i a, int n) {
  return n > 15 ? (__m256i){0, 0, 0, 0} : (__m256i)((sgl_u16x16)a << n);
}
PORTABLE __m256i _mm256_srli_epi16(__m256i a, int n) {
  return n > 15 ? (__m256i){0, 0, 0, 0} : (__m256i)((sgl_u16x16)a >> n);
}
PORTABLE __m128i _mm_slli_epi16(__m128i a, int n) {
  return n > 15 ? (__m128i){0, 0} : (__m128i)((sgl_u16x8)a << n);
}
PORTABLE __m256i _mm256_cvtepu8_epi32(__m128i a) {
  sgl_u8x16 b = (sgl_u8x16)a;
  sgl_i32x8 r;
  for (int i = 0; i < 8; i++) r[i] = b[i];
  return (__m256i)r;
}
PORTABLE __m256i _mm256_cvtepi8_epi32(__m128i a) {
  sgl_i8x16 b = (sgl_i8x16)a;
  sgl_i32x8 r;
  for (int i = 0; i < 8; i++) r[i] = b[i];
  return (__m256i)r;
}
PORTABLE __m256i _mm256_cvtepi8_epi16(__m128i a) {
  sgl_i8x16 b = (sgl_i8x16)a;
  sgl_i16x16 r;
  for (int i = 0; i < 16; i++) r[i] = b[i];
  return (__m256i)r;
}
PORTABLE __m256i _mm256_cvtepu16_epi32(__m128i a) {
  sgl_u16x8 h = (sgl_u16x8)a;
  sgl_i32x8 r;
  for (int i = 0; i < 8; i++) r[i] = h[i];
  return (__m256i)r;
}
PORTABLE __m128i _mm_cvtepi8_epi16(__m128i a) {
  sgl_i8x16 b = (sgl_i8x16)a;
  sgl_i16x8 r;
  for (int i = 0; i < 8; i++) r[i] = b[i];
  return (__m128i)r;
}
PORTABLE int16_t sgl_sat16(int32_t v) { return v > 32767 ? 32767 : v < -32768 ? -32768 : v; }
PORTABLE int8_t sgl_sat8(int32_t v) { return v > 127 ? 127 : v < -128 ? -128 : v; }
// unsigned bytes of a times signed bytes of b, adjacent pairs summed, saturated to int16
PORTABLE __m256i _mm256_maddubs_epi16(__m256i a, __m256i b) {
  sgl_u8x32 u = (sgl_u8x32)a;
  sgl_i8x32 s = (sgl_i8x32)b;
  sgl_i16x16 r;
  for (int i = 0; i < 16; i++)
    r[i] = sgl_sat16(u[2 * i] * s[2 * i] + u[2 * i + 1] * s[2 * i + 1]);
  return (__m256i)r;
}
// int16 pairs multiplied and summed into int32 (wrapping, as the instruction does)
PORTABLE __m256i _mm256_madd_epi16(__m256i a, __m256i b) {
  sgl_i16x16 x = (sgl_i16x16)a, y = (sgl_i16x16)b;
  sgl_i32x8 r;
  for (int i = 0; i < 8; i++)
    r[i] = (int32_t)(uint32_t)((int64_t)x[2 * i] * y[2 * i] + (int64_t)x[2 * i + 1] * y[2 * i + 1]);
  return (__m256i)r;
}
// a's bytes negated where b's are negative, zeroed where b's are zero
PORTABLE __m256i _mm256_sign_epi8(__m256i a, __m256i b) {
  sgl_i8x32 x = (sgl_i8x32)a, y = (sgl_i8x32)b, r;
  for (int i = 0; i < 32; i++) r[i] = y[i] < 0 ? (int8_t)(0 - (uint8_t)x[i]) : y[i] == 0 ? 0 : x[i];
  return (__m256i)r;
}
// int32 -> int16 saturated, within each 128-bit half: [a 0-3, b 0-3, a 4-7, b 4-7]
PORTABLE __m256i _mm256_packs_epi32(__m256i a, __m256i b) {
  sgl_i32x8 x = (sgl_i32x8)a, y = (sgl_i32x8)b;
  sgl_i16x16 r;
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 4; i++) {
      r[8 * h + i] = sgl_sat16(x[4 * h + i]);
      r[8 * h + 4 + i] = sgl_sat16(y[4 * h + i]);
    }
  return (__m256i)r;
}
// int16 -> int8 saturated: [a 0-7, b 0-7]
PORTABLE __m128i _mm_packs_epi16(__m128i a, __m128i b) {
  sgl_i16x8 x = (sgl_i16x8)a, y = (sgl_i16x8)b;
  sgl_i8x16 r;
  for (int i = 0; i < 8; i++) {
    r[i] = sgl_sat8(x[i]);
    r[8 + i] = sgl_sat8(y[i]);
  }
  return (__m128i)r;
}
PORTABLE __m128i _mm_shuffle_epi32(__m128i a, int imm) {
  sgl_i32x4 v = (sgl_i32x4)a, r;
  for (int i = 0; i < 4; i++) r[i] = v[(imm >> (2 * i)) & 3];
  return (__m128i)r;
}
PORTABLE __m128i _mm_unpacklo_epi64(__m128i a, __m128i b) { return (__m128i){a[0], b[0]}; }

#endif
