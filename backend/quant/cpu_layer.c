// sgl's CPU decode step in one call: every decoder layer of a quantized Llama-family model
// (Llama, Qwen2's q/k/v bias) plus the final norm, for T single-token rows (a decode batch),
// compiled into the library of cpu_kernel.c and cpu_ops.c (cpu_layer.py wraps it).
//
// Per layer, the ops of the model's op-by-op CPU path, called in the same order on the same
// values, so the hidden states (and the KV written to the pool) are bitwise equal to it:
//
//   h = rmsnorm(x + residual)                 sgl_rmsnorm (layer 0: rmsnorm(x), residual = x)
//   qkv = h @ Wqkv^T (+ b)                     sgl_qlinear_into
//   rotate q|k of qkv in place                 sgl_rope
//   k, v -> pool slots out_loc                 sgl_kv_store
//   attn = decode attention over the pool      sgl_decode_attn
//   x = attn @ Wo^T (+ b)                      sgl_qlinear_into
//   h = rmsnorm(x + residual)                  sgl_rmsnorm
//   x = silu(h @ Wgu^T) * ... @ Wdown^T        sgl_qlinear_into, sgl_silu_mul, sgl_qlinear_into
//
// What it saves is the Python between them: ~12 module calls, views and ctypes calls per
// layer (about a third of a one-row step on SmolLM2-135M). Nothing here allocates: the
// scratch comes from the caller, sized for `rows` by sgl_decode_scratch_floats.
#include <stdint.h>
#include <string.h>

// A QuantizedWeight (weight.py) as raw pointers; bias may be NULL.
typedef struct {
  int64_t bits, group_size, in_features, out_features;
  const void* codes;
  const float* scale;
  const float* zero;
  const float* bias;
} sgl_qweight;

typedef struct {
  sgl_qweight qkv, o, gate_up, down;
  const float* input_norm;
  const float* post_norm;
  float* k_cache;  // this layer's pool buffers [slots, kv_heads, head_dim]
  float* v_cache;
} sgl_layer;

typedef struct {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
  int64_t rope_half;       // rotate the first 2 * rope_half features of each head
  float eps, attn_scale;
  const float* rope_cache;  // [positions, 2 * rope_half]: cos | sin
  const float* final_norm;
  const sgl_layer* layers;
} sgl_model;

// (cpu_kernel.c, cpu_ops.c)
void sgl_qlinear_into(int bits, int gs, const float* x, int64_t M, int64_t K, const void* codes,
                      const float* scale, const float* zero, int64_t N, const float* bias,
                      float* y, int threads, float* xsum, float* xp);
void sgl_rmsnorm(const float* x, const float* r, const float* w, float eps, int64_t T,
                 int64_t H, float* out, float* sum);
void sgl_silu_mul(const float* x, int64_t T, int64_t I, float* out);
void sgl_rope(float* x, int64_t T, int64_t row_stride, int64_t heads, int64_t D,
              const int64_t* positions, const float* cache, int64_t half);
void sgl_kv_store(float* kbuf, float* vbuf, const float* k, int64_t k_stride, const float* v,
                  int64_t v_stride, const int64_t* loc, int64_t T, int64_t W);
int sgl_decode_attn(const float* q, int64_t q_stride, const int64_t* q_rows, int64_t B,
                    int64_t heads, int64_t kvh, int64_t D, const float* kbuf, const float* vbuf,
                    const int32_t* table, int64_t table_stride, const int64_t* table_rows,
                    const int64_t* lens, float scale, float* out, int threads);

static int64_t max3(int64_t a, int64_t b, int64_t c) {
  int64_t m = a > b ? a : b;
  return m > c ? m : c;
}

// The scratch layout of one step of `rows` rows, in floats (see sgl_decode_step).
typedef struct {
  int64_t x, h, qkv, attn, gate_up, act, xsum, xp, total;
} scratch_plan;

static scratch_plan plan_scratch(const sgl_model* m, int64_t rows) {
  int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
  int64_t k_max = max3(m->hidden, q, m->inter);
  scratch_plan p;
  p.x = 0;
  p.h = p.x + rows * m->hidden;
  p.qkv = p.h + rows * m->hidden;
  p.attn = p.qkv + rows * (q + 2 * kv);
  p.gate_up = p.attn + rows * q;
  p.act = p.gate_up + rows * 2 * m->inter;
  p.xsum = p.act + rows * m->inter;
  p.xp = p.xsum + rows * k_max;  // (group sizes >= 1: K / gs <= K sums per row)
  p.total = p.xp + rows * k_max;
  return p;
}

int64_t sgl_decode_scratch_floats(const sgl_model* m, int64_t rows) {
  return plan_scratch(m, rows).total;
}

static void project(const sgl_qweight* w, const float* x, int64_t T, float* y, float* xsum,
                    float* xp, int threads) {
  sgl_qlinear_into((int)w->bits, (int)w->group_size, x, T, w->in_features, w->codes, w->scale,
                   w->zero, w->out_features, w->bias, y, threads, xsum,
                   w->bits == 4 ? xp : NULL);
}

// One decoder layer on T rows. In: x (the previous layer's output; layer 0: the embeddings),
// residual (layer 0: none). Out: x = the MLP's output, residual = the stream before it.
static int layer_step(const sgl_model* m, const sgl_layer* L, int first, int64_t T,
                      const float* x_in, float* residual, float* s, const scratch_plan* p,
                      const int64_t* positions, const int64_t* out_loc, const int32_t* table,
                      int64_t table_stride, const int64_t* table_rows, const int64_t* lens,
                      int threads) {
  int64_t H = m->hidden, D = m->head_dim, q = m->heads * D, kv = m->kv_heads * D;
  int64_t qkv_w = q + 2 * kv;
  float *x = s + p->x, *h = s + p->h, *qkv = s + p->qkv, *attn = s + p->attn;
  float *gu = s + p->gate_up, *act = s + p->act, *xsum = s + p->xsum, *xp = s + p->xp;
  if (first) {  // the op path's `residual = x; h = rmsnorm(x)`
    memcpy(residual, x_in, sizeof(float) * (size_t)(T * H));
    sgl_rmsnorm(residual, NULL, L->input_norm, m->eps, T, H, h, NULL);
  } else {
    sgl_rmsnorm(x_in, residual, L->input_norm, m->eps, T, H, h, residual);
  }
  project(&L->qkv, h, T, qkv, xsum, xp, threads);  // [T, q | k | v]
  sgl_rope(qkv, T, qkv_w, m->heads + m->kv_heads, D, positions, m->rope_cache, m->rope_half);
  sgl_kv_store(L->k_cache, L->v_cache, qkv + q, qkv_w, qkv + q + kv, qkv_w, out_loc, T, kv);
  if (sgl_decode_attn(qkv, qkv_w, NULL, T, m->heads, m->kv_heads, D, L->k_cache, L->v_cache,
                      table, table_stride, table_rows, lens, m->attn_scale, attn, threads))
    return -1;
  project(&L->o, attn, T, x, xsum, xp, threads);  // [T, H]
  sgl_rmsnorm(x, residual, L->post_norm, m->eps, T, H, h, residual);
  project(&L->gate_up, h, T, gu, xsum, xp, threads);  // [T, 2 * inter]
  sgl_silu_mul(gu, T, m->inter, act);
  project(&L->down, act, T, x, xsum, xp, threads);  // [T, H]
  return 0;
}

// T single-token rows through every layer and the final norm.
//   x [T, hidden]: the embeddings (read only); out [T, hidden]: the final-normed hidden states;
//   residual [T, hidden]: work (the stream); positions, out_loc [T] int64: each row's position
//   and the pool slot its K/V goes to; row b's keys: the first lens[b] slots of
//   table[table_rows[b] * table_stride ...] (its own included); scratch: of
//   sgl_decode_scratch_floats(m, rows >= T) floats.
// Returns 0, or -1 when decode attention could not allocate its work buffer.
int sgl_decode_step(const sgl_model* m, int64_t T, const float* x, float* residual, float* out,
                    const int64_t* positions, const int64_t* out_loc, const int32_t* table,
                    int64_t table_stride, const int64_t* table_rows, const int64_t* lens,
                    float* scratch, int threads) {
  scratch_plan p = plan_scratch(m, T);
  for (int64_t l = 0; l < m->num_layers; l++) {
    const float* x_in = l == 0 ? x : scratch + p.x;
    if (layer_step(m, &m->layers[l], l == 0, T, x_in, residual, scratch, &p, positions, out_loc,
                   table, table_stride, table_rows, lens, threads))
      return -1;
  }
  sgl_rmsnorm(scratch + p.x, residual, m->final_norm, m->eps, T, m->hidden, out, residual);
  return 0;
}
