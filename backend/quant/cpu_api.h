// The library's entry points that its sources call across files (cpu_layer.c, cpu_int8.c) and
// that tests/cpu_portable_check.c drives: their prototypes in one place. (The defining files
// do not include it: their definitions carry the AVX2 target attribute. Python declares its
// own, as ctypes argtypes.)
#ifndef SGL_CPU_API_H
#define SGL_CPU_API_H

#include <stdint.h>

void sgl_qlinear(int bits, int gs, const float* x, int64_t M, int64_t K, const void* codes,
                 const void* scale, const void* zero, int f16, int64_t N, const float* bias,
                 float* y, int threads);
void sgl_qdequant(int bits, int gs, const void* codes, const void* scale, const void* zero,
                  int f16, int64_t N, int64_t K, float* out, int threads);
int sgl_q8_linear(int bits, int gs, const float* x, int64_t M, int64_t K, const void* codes,
                  const void* scale, const void* zero, int f16, int64_t N, const float* bias,
                  float* y, int threads);
int64_t sgl_qlinear_blocks(int64_t N);
void sgl_qlinear_block(int bits, int gs, const float* x, int64_t M, int64_t K, const void* codes,
                       const void* scale, const void* zero, int f16, int64_t N, const float* bias,
                       float* y, int64_t blk);
void sgl_q8_quantize(int bits, int gs, const float* x, int64_t M, int64_t K, float* buf,
                     float* xsum, int threads);
void sgl_q8_block(int bits, int gs, const float* buf, const float* xsum, int64_t M, int64_t K,
                  const void* codes, const void* scale, const void* zero, int f16, int64_t N,
                  const float* bias, float* y, int64_t blk);
void sgl_rmsnorm(const float* x, const float* r, const float* w, float eps, int64_t T,
                 int64_t H, float* out, float* sum);
void sgl_silu_mul(const float* x, int64_t T, int64_t I, float* out);
void sgl_rope(float* x, int64_t T, int64_t row_stride, int64_t heads, int64_t D,
              const int64_t* positions, const float* cache, int64_t half);
void sgl_kv_store(void* kbuf, void* vbuf, const float* k, int64_t k_stride, const float* v,
                  int64_t v_stride, const int64_t* loc, int64_t T, int64_t W, int kind);
int sgl_decode_attn(const float* q, int64_t q_stride, const int64_t* q_rows, int64_t B,
                    int64_t heads, int64_t kvh, int64_t D, const void* kbuf, const void* vbuf,
                    const int32_t* table, int64_t table_stride, const int64_t* table_rows,
                    const int64_t* lens, float scale, float* out, int threads, int kind);
void sgl_decode_attn_heads(const float* q, int64_t q_stride, int64_t b, int64_t hq, int64_t n,
                           int64_t heads, int64_t kvh, int64_t D, const void* kbuf,
                           const void* vbuf, const int32_t* table, int64_t table_stride,
                           const int64_t* table_rows, const int64_t* lens, float scale, float* out,
                           int kind, float* work);

#endif
