// sgl's CPU decode step in one call: every decoder layer of a quantized Llama-family model
// (Llama, Qwen2's q/k/v bias) plus the final norm, for T single-token rows (a decode batch),
// compiled into the library of cpu_kernel.c and cpu_ops.c (cpu_layer.py wraps it).
//
// Per layer, the ops of the model's op-by-op CPU path, called in the same order on the same
// values, so the hidden states (and the KV written to the pool) are bitwise equal to it:
//
//   h = rmsnorm(x + residual)                 sgl_rmsnorm (layer 0: rmsnorm(x), residual = x)
//   qkv = h @ Wqkv^T (+ b)                     sgl_qlinear
//   rotate q|k of qkv in place                 sgl_rope
//   k, v -> pool slots out_loc                 sgl_kv_store
//   attn = decode attention over the pool      sgl_decode_attn
//   x = attn @ Wo^T (+ b)                      sgl_qlinear
//   h = rmsnorm(x + residual)                  sgl_rmsnorm
//   x = silu(h @ Wgu^T) * ... @ Wdown^T        sgl_qlinear, sgl_silu_mul, sgl_qlinear
//
// What it saves is the Python between them: ~12 module calls, views and ctypes calls per
// layer (about a third of a one-row step on SmolLM2-135M). Nothing here allocates: the
// scratch comes from the caller, sized for `rows` by sgl_decode_scratch_floats.
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_simd.h"
#ifdef _OPENMP
#include <omp.h>
#else  // built without OpenMP (cpu_build.py: a compiler without it, such as macOS's clang)
static int omp_get_thread_num(void) { return 0; }  // (the parallel region: one thread)
#endif

// A QuantizedWeight (weight.py) as raw pointers; bias may be NULL. int8: its products
// quantize their input (cpu_int8.c), `int8_activations`. f16: scale and zero are float16.
typedef struct {
  int64_t bits, group_size, in_features, out_features;
  const void* codes;
  const void* scale;
  const void* zero;
  const float* bias;
  int64_t int8;
  int64_t f16;
} sgl_qweight;

typedef struct {
  sgl_qweight qkv, o, gate_up, down;
  const float* input_norm;
  const float* post_norm;
  void* k_cache;  // this layer's pool buffers [slots, kv_heads, head_dim] of kv_kind
  void* v_cache;
} sgl_layer;

typedef struct {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
  int64_t rope_half;       // rotate the first 2 * rope_half features of each head
  float eps, attn_scale;
  int64_t kv_kind;          // the pool's elements (cpu_ops.c: KV_F32, KV_F16, KV_BF16)
  const float* rope_cache;  // [positions, 2 * rope_half]: cos | sin
  const float* final_norm;
  const sgl_layer* layers;
} sgl_model;

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
  p.total = p.xp + rows * k_max + 16;  // (+16: cpu_int8.c's activation buffer, sgl_q8_floats)
  return p;
}

int64_t sgl_decode_scratch_floats(const sgl_model* m, int64_t rows) {
  return plan_scratch(m, rows).total;
}

// Threads of one step. A step is ~150 dependent pieces of work (per layer four projections,
// decode attention and the small ops between them); an OpenMP region or barrier per piece makes every
// thread wait for the slowest at each of them, which costs a scheduler timeslice whenever
// another process holds a core (measured 2-20x slower with two threads than one on a shared
// 2-core VM). Here the step is one parallel region: thread 0 runs the step and publishes each
// projection's blocks; helpers spin, claim blocks with a CAS and mark them done. Thread 0
// claims blocks too and waits only for blocks someone else has *claimed*: a helper that is
// not running claims nothing and delays nothing (its cost is one wait at the region's end).
// A claim takes 1 / (2 x threads) of the blocks left, not one (a quarter with two threads;
// a fixed quarter would leave one of eight threads a quarter of the work): at one row a block
// is ~0.4 us of work, and a CAS per block on a line both cores write, with `done` on the same
// line, left thread 0 spinning through much of a step (session 21, half-width AVX-512 EPYC:
// single stream 80-98 -> 118-119 tok/s, alternating runs of bench/cpu_engine.py; the
// 32-request row unchanged). A helper descheduled while it holds a claim delays thread 0 until
// it runs again, as it did holding one block; the rest of its claim adds microseconds.
// A job is a projection (its blocks of output features) or a layer's decode attention (its
// blocks are a row's query heads of one KV head, all of them or (few rows) one each:
// sgl_decode_attn_heads, the same bits as one thread's).
//
//   job = (stage << 40) | (blocks << 20) | next_block      one atomic word: a claim is a CAS
//                                                          on it, so it cannot hit a newer job
// A layer's decode attention as the team shares it (layer_step's arguments).
typedef struct {
  const sgl_model* m;
  const sgl_layer* L;
  const float* qkv;
  float* out;
  const int32_t* table;
  int64_t table_stride;
  const int64_t* table_rows;
  const int64_t* lens;
  // Query heads per block: a KV head's whole group (its keys and values read once for all of
  // them), or one head where that leaves too few blocks to share (a row or two).
  int64_t heads_per_block;
} attn_job;

typedef struct {
  _Atomic uint64_t job;
  // blocks of the current job finished (a cache line of its own: the claims' line is busy)
  _Alignas(64) _Atomic int64_t done;
  _Alignas(64) _Atomic int quit;
  // The current projection (written by thread 0 before it publishes `job`; read by a helper
  // only after it claimed a block, and not changed until every claimed block is done).
  const sgl_qweight* w;
  const float *x, *xp, *xsum;
  float* y;
  int64_t rows;
  const attn_job* attn;  // non-NULL: the current job is this attention, not a projection
  float* work;           // thread 0's attention buffer
  uint64_t stage;
  uint64_t share;  // a claim takes 1 / share of the blocks left: twice the threads
} team_t;

#define JOB_BITS 20
#define JOB_MASK ((1ull << JOB_BITS) - 1)

// Block `blk` of y = x @ W^T (+ b); int8 weights read the input `project` quantized into xp.
static void block(const sgl_qweight* w, const float* x, const float* xp, const float* xsum,
                  int64_t T, float* y, int64_t blk) {
  int bits = (int)w->bits, gs = (int)w->group_size;
  if (w->int8)
    sgl_q8_block(bits, gs, xp, xsum, T, w->in_features, w->codes, w->scale, w->zero,
                 (int)w->f16, w->out_features, w->bias, y, blk);
  else
    sgl_qlinear_block(bits, gs, x, T, w->in_features, w->codes, w->scale, w->zero, (int)w->f16,
                      w->out_features, w->bias, y, blk);
}

// work: this thread's attention buffer (sgl_decode_attn_heads's `work`).
static void run_block(team_t* t, int64_t blk, float* work) {
  const attn_job* a = t->attn;
  if (a == NULL) {
    block(t->w, t->x, t->xp, t->xsum, t->rows, t->y, blk);
    return;
  }
  const sgl_model* m = a->m;
  int64_t D = m->head_dim, qkv_w = (m->heads + 2 * m->kv_heads) * D;
  int64_t n = a->heads_per_block, per_row = m->heads / n;
  sgl_decode_attn_heads(a->qkv, qkv_w, blk / per_row, blk % per_row * n, n, m->heads,
                        m->kv_heads, D, a->L->k_cache, a->L->v_cache, a->table, a->table_stride,
                        a->table_rows, a->lens, m->attn_scale, a->out, (int)m->kv_kind, work);
}

// Claims and runs blocks of the current job until none is left; returns how many it ran. A
// claim takes 1 / (2 x threads) of what is left (at least one block; a quarter with two
// threads): few claims, each a CAS on a line every core writes, and a short tail where the
// last blocks go one at a time, so no thread holds much more than its share at the end.
static int64_t claim_blocks(team_t* t, uint64_t stage, float* work) {
  int64_t ran = 0;
  for (;;) {
    uint64_t job = atomic_load_explicit(&t->job, memory_order_acquire);
    uint64_t next = job & JOB_MASK, blocks = (job >> JOB_BITS) & JOB_MASK;
    if ((job >> (2 * JOB_BITS)) != stage || next >= blocks) return ran;
    uint64_t take = (blocks - next) / t->share;
    take = take > 0 ? take : 1;
    if (!atomic_compare_exchange_weak_explicit(&t->job, &job, job + take, memory_order_acq_rel,
                                               memory_order_relaxed))
      continue;
    for (uint64_t b = next; b < next + take; b++) run_block(t, (int64_t)b, work);
    atomic_fetch_add_explicit(&t->done, (int64_t)take, memory_order_release);
    ran += (int64_t)take;
  }
}

static void helper_loop(team_t* t, float* work) {
  while (!atomic_load_explicit(&t->quit, memory_order_acquire)) {
    uint64_t job = atomic_load_explicit(&t->job, memory_order_acquire);
    if ((job & JOB_MASK) < ((job >> JOB_BITS) & JOB_MASK))
      claim_blocks(t, job >> (2 * JOB_BITS), work);
    else
      _mm_pause();
  }
}

// Publishes the job described in t's fields as `blocks` blocks, runs its share, waits for the
// blocks the helpers claimed. work: thread 0's attention buffer.
static void share(team_t* t, int64_t blocks, float* work) {
  t->stage++;
  atomic_store_explicit(&t->done, 0, memory_order_relaxed);  // (no helper touches it now)
  atomic_store_explicit(&t->job, (t->stage << (2 * JOB_BITS)) | ((uint64_t)blocks << JOB_BITS),
                        memory_order_release);
  claim_blocks(t, t->stage, work);
  while (atomic_load_explicit(&t->done, memory_order_acquire) < blocks) _mm_pause();
}

// y [T, N] = x [T, K] @ W^T (+ b), shared with the helpers; the same blocks, so the same bits,
// as sgl_qlinear. `t` NULL: alone.
static void project(team_t* t, const sgl_qweight* w, const float* x, int64_t T, float* y,
                    float* xsum, float* xp) {
  int bits = (int)w->bits, gs = (int)w->group_size;
  if (w->int8) sgl_q8_quantize(bits, gs, x, T, w->in_features, xp, xsum, 1);
  int64_t blocks = sgl_qlinear_blocks(w->out_features);
  if (t == NULL) {
    for (int64_t b = 0; b < blocks; b++) block(w, x, xp, xsum, T, y, b);
    return;
  }
  t->w = w, t->x = x, t->xp = xp, t->xsum = xsum, t->y = y, t->rows = T, t->attn = NULL;
  share(t, blocks, NULL);
}

// Decode attention of a layer's T rows into `out`: alone, sgl_decode_attn on this thread; in a
// team, its blocks of query heads shared. Returns -1 when a buffer could not be had.
static int attend(team_t* t, const attn_job* a, int64_t T) {
  const sgl_model* m = a->m;
  int64_t D = m->head_dim, qkv_w = (m->heads + 2 * m->kv_heads) * D;
  if (t == NULL)
    return sgl_decode_attn(a->qkv, qkv_w, NULL, T, m->heads, m->kv_heads, D, a->L->k_cache,
                           a->L->v_cache, a->table, a->table_stride, a->table_rows, a->lens,
                           m->attn_scale, a->out, 1, (int)m->kv_kind);
  t->attn = a;
  share(t, T * m->heads / a->heads_per_block, t->work);
  return 0;
}

// One decoder layer on T rows. In: x (the previous layer's output; layer 0: the embeddings),
// residual (layer 0: none). Out: x = the MLP's output, residual = the stream before it.
static int layer_step(team_t* team, const sgl_model* m, const sgl_layer* L, int first, int64_t T,
                      const float* x_in, float* residual, float* s, const scratch_plan* p,
                      const int64_t* positions, const int64_t* out_loc, const int32_t* table,
                      int64_t table_stride, const int64_t* table_rows, const int64_t* lens) {
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
  project(team, &L->qkv, h, T, qkv, xsum, xp);  // [T, q | k | v]
  sgl_rope(qkv, T, qkv_w, m->heads + m->kv_heads, D, positions, m->rope_cache, m->rope_half);
  sgl_kv_store(L->k_cache, L->v_cache, qkv + q, qkv_w, qkv + q + kv, qkv_w, out_loc, T, kv,
               (int)m->kv_kind);
  int64_t group = m->heads / m->kv_heads;
  attn_job job = {m, L, qkv, attn, table, table_stride, table_rows, lens,
                  T * m->kv_heads >= 8 ? group : 1};
  if (attend(team, &job, T)) return -1;
  project(team, &L->o, attn, T, x, xsum, xp);  // [T, H]
  sgl_rmsnorm(x, residual, L->post_norm, m->eps, T, H, h, residual);
  project(team, &L->gate_up, h, T, gu, xsum, xp);  // [T, 2 * inter]
  sgl_silu_mul(gu, T, m->inter, act);
  project(team, &L->down, act, T, x, xsum, xp);  // [T, H]
  return 0;
}

// T single-token rows through every layer and the final norm.
//   x [T, hidden]: the embeddings (read only); out [T, hidden]: the final-normed hidden states;
//   residual [T, hidden]: work (the stream); positions, out_loc [T] int64: each row's position
//   and the pool slot its K/V goes to; row b's keys: the first lens[b] slots of
//   table[table_rows[b] * table_stride ...] (its own included); scratch: of
//   sgl_decode_scratch_floats(m, rows >= T) floats.
// Returns 0, or -1 when decode attention could not allocate its work buffer.
static int run_layers(team_t* team, const sgl_model* m, int64_t T, const float* x,
                      float* residual, float* out, const int64_t* positions,
                      const int64_t* out_loc, const int32_t* table, int64_t table_stride,
                      const int64_t* table_rows, const int64_t* lens, float* scratch) {
  scratch_plan p = plan_scratch(m, T);
  for (int64_t l = 0; l < m->num_layers; l++) {
    const float* x_in = l == 0 ? x : scratch + p.x;
    if (layer_step(team, m, &m->layers[l], l == 0, T, x_in, residual, scratch, &p, positions,
                   out_loc, table, table_stride, table_rows, lens))
      return -1;
  }
  sgl_rmsnorm(scratch + p.x, residual, m->final_norm, m->eps, T, m->hidden, out, residual);
  return 0;
}

int sgl_decode_step(const sgl_model* m, int64_t T, const float* x, float* residual, float* out,
                    const int64_t* positions, const int64_t* out_loc, const int32_t* table,
                    int64_t table_stride, const int64_t* table_rows, const int64_t* lens,
                    float* scratch, int threads) {
#ifndef _OPENMP
  threads = 1;  // (no helpers without OpenMP)
#endif
  if (threads <= 1)
    return run_layers(NULL, m, T, x, residual, out, positions, out_loc, table, table_stride,
                      table_rows, lens, scratch);
  // Each thread's attention buffer: one block at a time (up to a KV head's query heads), the
  // longest row's keys.
  int64_t max_len = 0;
  for (int64_t b = 0; b < T; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
  size_t work_bytes = sizeof(float) * (size_t)(m->heads / m->kv_heads * (max_len + m->head_dim));
  team_t team = {0};
  team.share = 2 * (uint64_t)(threads > 1 ? threads : 1);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float* work = (float*)malloc(work_bytes);
    if (omp_get_thread_num() == 0) {
      team.work = work;
      failed = work == NULL ? -1
                            : run_layers(&team, m, T, x, residual, out, positions, out_loc,
                                         table, table_stride, table_rows, lens, scratch);
      atomic_store_explicit(&team.quit, 1, memory_order_release);
    } else if (work != NULL) {  // (without a buffer a helper sits out: thread 0 runs it all)
      helper_loop(&team, work);
    }
    free(work);
  }
  return failed;
}
