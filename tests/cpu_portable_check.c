// Drives the CPU library's entry points (backend/quant/cpu_*.c) on fixed pseudo-random inputs
// and prints one line per case: its name and a hash of the output bytes. Built with the
// library's sources twice by tests/test_cpu_portable.py, once for this machine with
// SGL_PORTABLE and once for aarch64 (run under qemu): the lines must be the same, i.e. the ARM
// build gives the portable build's bits (which the other tests compare with the AVX2 build's).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"

static uint64_t state = 0x9E3779B97F4A7C15ull;

static uint64_t next(void) {  // xorshift64*
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 0x2545F4914F6CDD1Dull;
}

static float* floats(size_t n, float scale) {  // uniform in [-scale, scale)
  float* p = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) p[i] = ((float)(next() >> 40) / 16777216.0f * 2 - 1) * scale;
  return p;
}

static uint8_t* bytes(size_t n) {
  uint8_t* p = malloc(n);
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(next() >> 56);
  return p;
}

static uint16_t* halves(size_t n) {  // float16 scales in [2^-10, 2^-6)
  uint16_t* p = malloc(n * 2);
  for (size_t i = 0; i < n; i++) p[i] = (uint16_t)(0x1400 + (next() >> 54));
  return p;
}

static void report(const char* name, const void* data, size_t n) {  // FNV-1a over the bytes
  uint64_t h = 0xCBF29CE484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t*)data)[i]) * 0x100000001B3ull;
  printf("%s %016llx\n", name, (unsigned long long)h);
}

static void products(void) {
  const int64_t N = 37, K = 512;
  for (int bits = 4; bits <= 8; bits += 4)
    for (int gs = 16; gs <= 32; gs += 16)
      for (int f16 = 0; f16 <= 1; f16++) {
        if (bits == 4 && gs == 16) continue;  // (4-bit groups are 32 wide)
        int64_t G = K / gs;
        uint8_t* codes = bytes((size_t)(N * K));
        void* scale = f16 ? (void*)halves((size_t)(N * G)) : (void*)floats((size_t)(N * G), 0.01f);
        void* zero = f16 ? (void*)halves((size_t)(N * G)) : (void*)floats((size_t)(N * G), 0.1f);
        float* bias = floats(N, 1);
        for (int64_t M = 1; M <= 33; M += 8) {
          float* x = floats((size_t)(M * K), 1);
          float* y = malloc(sizeof(float) * (size_t)(M * N));
          char name[64];
          sgl_qlinear(bits, gs, x, M, K, codes, scale, zero, f16, N, bias, y, 2);
          snprintf(name, sizeof name, "qlinear-%d-%d-%d-%lld", bits, gs, f16, (long long)M);
          report(name, y, sizeof(float) * (size_t)(M * N));
          if (sgl_q8_linear(bits, gs, x, M, K, codes, scale, zero, f16, N, NULL, y, 2) == 0) {
            snprintf(name, sizeof name, "q8linear-%d-%d-%d-%lld", bits, gs, f16, (long long)M);
            report(name, y, sizeof(float) * (size_t)(M * N));
          }
          free(x);
          free(y);
        }
        float* w = malloc(sizeof(float) * (size_t)(N * K));
        sgl_qdequant(bits, gs, codes, scale, zero, f16, N, K, w, 2);
        report("dequant", w, sizeof(float) * (size_t)(N * K));
        free(w);
        free(codes);
        free(scale);
        free(zero);
        free(bias);
      }
}

static void decode_ops(void) {
  const int64_t T = 5, H = 576, I = 1536, heads = 9, kvh = 3, D = 64, slots = 300, half = 32;
  float* x = floats((size_t)(T * H), 2);
  float* r = floats((size_t)(T * H), 2);
  float* w = floats(H, 1);
  float* out = malloc(sizeof(float) * (size_t)(T * H));
  float* sum = malloc(sizeof(float) * (size_t)(T * H));
  sgl_rmsnorm(x, r, w, 1e-5f, T, H, out, sum);
  report("rmsnorm", out, sizeof(float) * (size_t)(T * H));
  report("rmsnorm-sum", sum, sizeof(float) * (size_t)(T * H));
  float* gu = floats((size_t)(T * 2 * I), 8);
  float* act = malloc(sizeof(float) * (size_t)(T * I));
  sgl_silu_mul(gu, T, I, act);
  report("silu_mul", act, sizeof(float) * (size_t)(T * I));
  float* qk = floats((size_t)(T * (heads + kvh) * D), 2);
  float* cache = floats((size_t)(4096 * 2 * half), 1);
  int64_t positions[5] = {0, 7, 100, 1000, 4095};
  sgl_rope(qk, T, (heads + kvh) * D, heads + kvh, D, positions, cache, half);
  report("rope", qk, sizeof(float) * (size_t)(T * (heads + kvh) * D));
  int32_t* table = malloc(sizeof(int32_t) * (size_t)(T * slots));
  for (int64_t b = 0; b < T; b++)
    for (int64_t i = 0; i < slots; i++) table[b * slots + i] = (int32_t)((i * 7 + b * 31) % slots);
  int64_t lens[5] = {1, 13, 64, 150, 299}, rows[5] = {0, 1, 2, 3, 4}, loc[5];
  for (int64_t b = 0; b < T; b++) loc[b] = table[b * slots + lens[b] - 1];
  const size_t esize[4] = {4, 2, 2, 1};
  for (int kind = 0; kind < 4; kind++) {
    size_t pool = (size_t)(slots * kvh * D) * esize[kind];
    uint8_t* kbuf = bytes(pool);
    uint8_t* vbuf = bytes(pool);
    if (kind != 3)  // (random bytes are NaNs and infinities in the wider formats: finite ones)
      for (size_t i = 0; i < pool; i += esize[kind]) kbuf[i + esize[kind] - 1] &= 0x3F, vbuf[i + esize[kind] - 1] &= 0x3F;
    else
      for (size_t i = 0; i < pool; i++) kbuf[i] &= 0xBF, vbuf[i] &= 0xBF;
    float* k = qk + heads * D;
    sgl_kv_store(kbuf, vbuf, k, (heads + kvh) * D, k, (heads + kvh) * D, loc, T, kvh * D, kind);
    float* att = malloc(sizeof(float) * (size_t)(T * heads * D));
    if (sgl_decode_attn(qk, (heads + kvh) * D, rows, T, heads, kvh, D, kbuf, vbuf, table, slots,
                        rows, lens, 0.125f, att, 2, kind) != 0)
      abort();
    char name[32];
    snprintf(name, sizeof name, "kv_store-%d", kind);
    report(name, kbuf, pool);
    snprintf(name, sizeof name, "decode_attn-%d", kind);
    report(name, att, sizeof(float) * (size_t)(T * heads * D));
    free(kbuf);
    free(vbuf);
    free(att);
  }
}

int main(void) {
  products();
  decode_ops();
  return 0;
}
