/* float32 matrix products for a few rows (decoding one sequence or a batch), for x86-64 CPUs with AVX2 and FMA,
   called by llmcourse.engine.cpu_kernels.

   A decode step multiplies one row per sequence by every weight matrix: it reads each weight once and does two
   FLOPs with it, so its speed is the speed at which the weights stream in from memory. These kernels read each
   weight once, in the order it lies in memory, and keep the partial sums in registers.

   The weights are w [N, K] (nn.Linear's layout; the engine stores GPT-2's [K, N] weights transposed, so the same):
   y[m, n] = dot(x[m], w[n]), 8 lanes summed in a fixed order. Every output is summed the same way whatever the
   number of rows, the tile it falls in and the number of threads, so a row's result does not depend on the other
   rows of a batch: decoding a batch gives each sequence exactly the numbers of decoding it alone.

   The outputs are cut into chunks of whole weight rows, each one stretch of memory, which any of the pool's
   threads takes (pool.c). (The checkpoint's own [K, N] layout, cut by columns, read K short runs a chunk and ran
   at 19 GB/s on two threads where this one runs at 37; benchmarks.md.) */

#include <immintrin.h>
#include <stddef.h>

#include "pool.h"
#include "simd.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* `rows` rows x `cols` outputs (constants once inlined): sums of 8 lanes, lane i summing k = i, i + 8, ... */
ALWAYS_INLINE void tile(const float* x, ptrdiff_t ldx, const float* w, ptrdiff_t ldw, int K, int rows, int cols,
                        float* dots /* [rows][cols] */)
{
  __m256 a[3][16]; /* [rows][cols]: at most 1 x 16 or 3 x 4 */
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < cols; c++) a[m][c] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    if (rows == 1) { /* one row: its weights loaded as they are used, 16 outputs in flight (8 read 1.1x slower) */
      __m256 v = _mm256_loadu_ps(x + k);
      for (int c = 0; c < cols; c++) a[0][c] = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + c * ldw + k), a[0][c]);
      continue;
    }
    __m256 wv[4];
    for (int c = 0; c < cols; c++) wv[c] = _mm256_loadu_ps(w + c * ldw + k);
    for (int m = 0; m < rows; m++) {
      __m256 v = _mm256_loadu_ps(x + m * ldx + k);
      for (int c = 0; c < cols; c++) a[m][c] = _mm256_fmadd_ps(v, wv[c], a[m][c]);
    }
  }
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < cols; c++) dots[m * cols + c] = sum8(a[m][c]);
}

static void block(const float* x, ptrdiff_t ldx, const float* w, ptrdiff_t ldw, int K, int rows, int cols,
                  float* dots)
{
  if (rows == 1 && cols == 16) tile(x, ldx, w, ldw, K, 1, 16, dots);
  else if (rows == 3 && cols == 4) tile(x, ldx, w, ldw, K, 3, 4, dots);
  else if (rows == 2 && cols == 4) tile(x, ldx, w, ldw, K, 2, 4, dots);
  else if (rows == 1 && cols == 4) tile(x, ldx, w, ldw, K, 1, 4, dots);
  else /* the tails: one output at a time, the same lanes and the same sum */
    for (int m = 0; m < rows; m++)
      for (int c = 0; c < cols; c++) tile(x + m * ldx, ldx, w + c * ldw, ldw, K, 1, 1, dots + m * cols + c);
}

struct linear_job {
  const float *x, *w, *bias;
  float* y;
  ptrdiff_t ldx, ldw;
  int M, N, K, wide, tiles_per_chunk;
};

/* Tiles t .. t + tiles_per_chunk - 1 of `wide` outputs each, for all the rows. */
static void linear_chunk(const void* args, int chunk)
{
  const struct linear_job* j = args;
  const int first = chunk * j->tiles_per_chunk * j->wide;
  const int last = first + j->tiles_per_chunk * j->wide < j->N ? first + j->tiles_per_chunk * j->wide : j->N;
  for (int n0 = first; n0 < last; n0 += j->wide) {
    const int cols = last - n0 < j->wide ? last - n0 : j->wide;
    float dots[3 * 16];
    for (int m0 = 0; m0 < j->M; m0 += 3) {
      const int rows = j->M - m0 < 3 ? j->M - m0 : 3;
      block(j->x + m0 * j->ldx, j->ldx, j->w + n0 * j->ldw, j->ldw, j->K, rows, cols, dots);
      for (int m = 0; m < rows; m++)
        for (int c = 0; c < cols; c++)
          j->y[(size_t)(m0 + m) * j->N + n0 + c] = dots[m * cols + c] + (j->bias ? j->bias[n0 + c] : 0.f);
    }
  }
}

/* y [M, N] = x [M, K] @ w[N, K].T + bias [N] (or NULL); K a multiple of 8. */
void float_linear(const float* x, ptrdiff_t ldx, const float* w, ptrdiff_t ldw, const float* bias, float* y,
                  int M, int N, int K, int threads)
{
  const int wide = M == 1 ? 16 : 4, tiles = (N + wide - 1) / wide;
  const int per_chunk = pool_chunk_units(tiles, (size_t)wide * K * sizeof(float), 1);
  struct linear_job job = {x, w, bias, y, ldx, ldw, M, N, K, wide, per_chunk};
  pool_run(threads, (tiles + per_chunk - 1) / per_chunk, linear_chunk, &job);
}
