// What sgl's CPU C files share (cpu_kernel.c, cpu_int8.c, cpu_ops.c): the AVX2 target and
// inlining attributes, the horizontal sum of 8 lanes and the exact zero term of a group
// quantized product. Their summation orders are part of the kernels' results (the one-call
// decode step is bitwise equal to the op path because both call these), so change them only
// together with the tests that pin those results.
#ifndef SGL_CPU_SIMD_H
#define SGL_CPU_SIMD_H

#include <immintrin.h>
#include <stdint.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

AVX2 INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum over groups g of zero[g] * xsum[g]: one row's and one feature's zero term (exact float
// group sums of the input times the weight's per-group zero).
AVX2 INLINE float zero_term(const float* z, const float* xs, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(z + g), _mm256_loadu_ps(xs + g), acc);
  float t = hsum8(acc);
  for (; g < G; g++) t += z[g] * xs[g];
  return t;
}

#endif
