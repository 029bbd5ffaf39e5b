// sgl's CPU helper team (cpu_team.c): helper threads that share out the blocks of a product or
// of a layer's decode attention with the calling thread, kept between calls.
#ifndef SGL_CPU_TEAM_H
#define SGL_CPU_TEAM_H

#include <stdint.h>

typedef struct sgl_team sgl_team;

// Runs block `blk` of the current job; `worker` is 0 for the calling thread, 1.. for helpers
// (below sgl_team_workers of the session).
typedef void (*sgl_team_fn)(const void* ctx, int64_t blk, int worker);

// Opens a session of up to `threads` threads (the caller and threads - 1 helpers, created on
// first use), or NULL: the caller runs alone (threads <= 1, another caller holds the team, or
// no helper could be created).
sgl_team* sgl_team_begin(int threads);

// Workers that may run blocks in this session (the caller included): size per-worker buffers
// by it.
int sgl_team_workers(const sgl_team* t);

// Runs blocks [0, blocks) of fn on the caller and the helpers; returns when all are done.
// ctx must stay valid and unchanged until then. blocks < 2^20.
void sgl_team_run(sgl_team* t, sgl_team_fn fn, const void* ctx, int64_t blocks);

// Closes the session (returns at once: helpers are never waited for here).
void sgl_team_end(sgl_team* t);

#endif
