/* The kernels' threads (pool.c). */

#ifndef LLMCOURSE_POOL_H
#define LLMCOURSE_POOL_H

/* One chunk of a job: task(args, chunk) computes chunk `chunk` of the job's output, independently of the others. */
typedef void (*pool_task)(const void* args, int chunk);

/* task(args, c) for every c in [0, chunks), on up to `threads` threads (the caller one of them); returns when all
   are done. chunks <= 65535. */
void pool_run(int threads, int chunks, pool_task task, const void* args);

/* Tests: with 1, the helpers take no chunk (as if the system had parked them all); 0 lets them work again. */
void pool_hold_helpers(int held);

#endif
