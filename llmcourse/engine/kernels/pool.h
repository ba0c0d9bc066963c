/* The kernels' threads (pool.c). */

#ifndef LLMCOURSE_POOL_H
#define LLMCOURSE_POOL_H

#include <stddef.h>

/* One chunk of a job: task(args, chunk) computes chunk `chunk` of the job's output, independently of the others. */
typedef void (*pool_task)(const void* args, int chunk);

/* task(args, c) for every c in [0, chunks), on up to `threads` threads (the caller one of them); returns when all
   are done. chunks <= 65535. */
void pool_run(int threads, int chunks, pool_task task, const void* args);

/* How many of `units` (weight rows, heads, ...) of `unit_bytes` each a chunk takes: about POOL_CHUNK_BYTES of
   memory read (small chunks balance the threads; each one's few hundred nanoseconds of handing out are paid per
   chunk), a multiple of `multiple`, and at most 65535 chunks. */
#define POOL_CHUNK_BYTES 16384
static inline int pool_chunk_units(int units, size_t unit_bytes, int multiple)
{
  size_t per = POOL_CHUNK_BYTES / (unit_bytes ? unit_bytes : 1);
  if (per * 65535 < (size_t)units) per = ((size_t)units + 65534) / 65535;
  per = (per + multiple - 1) / multiple * multiple;
  return per < (size_t)multiple ? multiple : (int)per;
}

/* Tests: with 1, the helpers take no chunk (as if the system had parked them all); 0 lets them work again. */
void pool_hold_helpers(int held);

#endif
