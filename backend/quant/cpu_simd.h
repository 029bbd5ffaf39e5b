// What sgl's CPU C files share (cpu_kernel.c, cpu_int8.c, cpu_ops.c): the AVX2 target and
// inlining attributes, the horizontal sum of 8 lanes and the exact zero term of a group
// quantized product. Their summation orders are part of the kernels' results (the one-call
// decode step is bitwise equal to the op path because both call these), so change them only
// together with the tests that pin those results.
#ifndef SGL_CPU_SIMD_H
#define SGL_CPU_SIMD_H

#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(SGL_PORTABLE)
#define SGL_X86 1
#include <immintrin.h>
// (F16C: every AVX2 CPU has it; sgl_cpu_ok checks. Weights' float16 scales widen with it.)
#define AVX2 __attribute__((target("avx2,fma,f16c")))
// The AVX-512 twins of some loops (cpu_kernel.c, cpu_ops.c), chosen at run time where the CPU
// has it; compiled on x86-64 only (#if SGL_X86).
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))
#else
// Any other CPU (ARM), or SGL_PORTABLE: the same intrinsics in portable C, the same bits.
#define SGL_X86 0
#include "cpu_portable.h"
#define AVX2
#endif
// Whether the AVX-512 twins run (cpu_kernel.c: set at load, switched by sgl_use_avx512). A twin
// is a function of its own named *_512, never inlined into AVX2 code.
int sgl_avx512_on(void);

AVX2 INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


// A weight's per-group scales or zeros (weight.py): float32, or float16 when `f16` (exact
// for the formats that store them so). n values from src as float32: src itself, or their
// widened copy in dst (n floats).
AVX2 INLINE const float* group_floats(const void* src, int f16, int64_t n, float* dst) {
  if (!f16) return (const float*)src;
  const uint16_t* h = (const uint16_t*)src;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
  for (; i < n; i++) dst[i] = _cvtsh_ss(h[i]);
  return dst;
}

// Element i of such a row, as float32.
AVX2 INLINE float group_float(const void* src, int f16, int64_t i) {
  return f16 ? _cvtsh_ss(((const uint16_t*)src)[i]) : ((const float*)src)[i];
}

// Bytes of one scale or zero.
INLINE int64_t group_bytes(int f16) { return f16 ? 2 : 4; }

// sum over groups g of zero[g] * xsum[g]: one row's and one feature's zero term (exact float
// group sums of the input times the weight's per-group zero; z float16 when f16, widened as
// loaded: the same arithmetic either way).
AVX2 INLINE float zero_term(const void* z, int f16, const float* xs, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    __m256 zv = f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)z + g)))
                    : _mm256_loadu_ps((const float*)z + g);
    acc = _mm256_fmadd_ps(zv, _mm256_loadu_ps(xs + g), acc);
  }
  float t = hsum8(acc);
  for (; g < G; g++) t += group_float(z, f16, g) * xs[g];
  return t;
}

#endif
