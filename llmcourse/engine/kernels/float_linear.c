/* float32 matrix products for a few rows (decoding one sequence or a batch), for x86-64 CPUs with AVX2 and FMA,
   called by llmcourse.engine.cpu_kernels.

   A decode step multiplies one row per sequence by every weight matrix: it reads each weight once and does two
   FLOPs with it, so its speed is the speed at which the weights stream in from memory. These kernels read each
   weight once, in the order it lies in memory, and keep the partial sums in registers.

   Two layouts, as the models store them:
   - "kn": w [K, N] (GPT-2's Conv1D weights, and its tied head, stored column-major): a row of 16 (or 64) outputs
     at a time, y[m, n] += x[m, k] * w[k, n] for k in order;
   - "nk": w [N, K] (nn.Linear's, the Llama family's): y[m, n] = dot(x[m], w[n]), 8 lanes summed in a fixed order.
   Every output is summed the same way whatever the number of rows, the tile it falls in and the number of
   threads, so a row's result does not depend on the other rows of a batch: decoding a batch gives each sequence
   exactly the numbers of decoding it alone. */

#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#include "simd.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---------------------------------------------------------------------------------- kn: w [K, N], row stride ldw */

/* Each thread takes blocks of columns; a block's sums, rows x width (at most BLOCK floats: 16 KB), stay in the L1
   cache while the weights stream through eight rows at a time (eight runs through memory, BLOCK / rows floats
   each), every weight used for all the rows of x. Each output is the multiply-adds of its column in the order of k.
   (Measured on an AMD EPYC, one thread: 21-25 GB/s for GPT-2's layers and head, where a plain read runs at
   25-31 GB/s; one row at a time ran at 10-25 GB/s, depending on where the sums and the weights fall in the
   4 KB pages, and a panel of 64 columns down all the rows at 12.) */
#define BLOCK 4096

static void kn_block(const float* x, ptrdiff_t ldx, const float* w, ptrdiff_t ldw, int K, int M, int n, float* acc)
{
  for (int i = 0; i < M * n; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    const float* r[8];
    for (int i = 0; i < 8; i++) r[i] = w + (k + i) * ldw;
    for (int m = 0; m < M; m++) {
      __m256 b[8];
      for (int i = 0; i < 8; i++) b[i] = _mm256_broadcast_ss(x + m * ldx + k + i);
      float* am = acc + m * n;
      for (int j = 0; j < n; j += 8) {
        __m256 a = _mm256_loadu_ps(am + j);
        for (int i = 0; i < 8; i++) a = _mm256_fmadd_ps(b[i], _mm256_loadu_ps(r[i] + j), a);
        _mm256_storeu_ps(am + j, a);
      }
    }
  }
  for (; k < K; k++)
    for (int m = 0; m < M; m++) {
      __m256 b = _mm256_broadcast_ss(x + m * ldx + k);
      for (int j = 0; j < n; j += 8)
        _mm256_storeu_ps(acc + m * n + j, _mm256_fmadd_ps(b, _mm256_loadu_ps(w + k * ldw + j), _mm256_loadu_ps(acc + m * n + j)));
    }
}

/* The last N % 8 outputs, one at a time: the same multiply-adds, in the same order, as the vector lanes. */
static float kn_one(const float* x, const float* w, ptrdiff_t ldw, int K)
{
  float acc = 0.f;
  for (int k = 0; k < K; k++) acc = fmaf(x[k], w[k * ldw], acc);
  return acc;
}

/* y [M, N] = x [M, K] @ w [K, N] + bias [N] (or NULL), M <= BLOCK / 8. Rows of x and w are ldx and ldw floats
   apart. */
void float_linear_kn(const float* x, ptrdiff_t ldx, const float* w, ptrdiff_t ldw, const float* bias, float* y,
                     int M, int N, int K, int threads)
{
  /* blocks of at most BLOCK / M columns, and at least one per thread */
  const int N8 = N / 8 * 8, per_thread = (N8 / threads + 7) / 8 * 8, most = BLOCK / M / 8 * 8;
  const int width = per_thread > 0 && per_thread < most ? per_thread : most, blocks = (N8 + width - 1) / width;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t <= blocks; t++) {
    const int n0 = t * width;
    if (t == blocks) { /* the last N % 8 columns */
      for (int m = 0; m < M; m++)
        for (int n = N8; n < N; n++) y[(size_t)m * N + n] = kn_one(x + m * ldx, w + n, ldw, K) + (bias ? bias[n] : 0.f);
      continue;
    }
    const int n = N8 - n0 < width ? N8 - n0 : width;
    float acc[BLOCK] __attribute__((aligned(64)));
    kn_block(x, ldx, w + n0, ldw, K, M, n, acc);
    for (int m = 0; m < M; m++)
      for (int j = 0; j < n; j++) y[(size_t)m * N + n0 + j] = acc[m * n + j] + (bias ? bias[n0 + j] : 0.f);
  }
}

/* ---------------------------------------------------------------------------------- nk: w [N, K], row stride ldw */

/* `rows` rows x `cols` outputs (constants once inlined): sums of 8 lanes, lane i summing k = i, i + 8, ... */
ALWAYS_INLINE void nk_tile(const float* x, ptrdiff_t ldx, const float* w, ptrdiff_t ldw, int K, int rows, int cols,
                           float* dots /* [rows][cols] */)
{
  __m256 a[3][8];
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < cols; c++) a[m][c] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    if (rows == 1) { /* one row: its weights loaded as they are used (8 outputs in flight) */
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

static void nk_block(const float* x, ptrdiff_t ldx, const float* w, ptrdiff_t ldw, int K, int rows, int cols,
                     float* dots)
{
  if (rows == 1 && cols == 8) nk_tile(x, ldx, w, ldw, K, 1, 8, dots);
  else if (rows == 3 && cols == 4) nk_tile(x, ldx, w, ldw, K, 3, 4, dots);
  else if (rows == 2 && cols == 4) nk_tile(x, ldx, w, ldw, K, 2, 4, dots);
  else if (rows == 1 && cols == 4) nk_tile(x, ldx, w, ldw, K, 1, 4, dots);
  else /* the tails: one output at a time, the same lanes and the same sum */
    for (int m = 0; m < rows; m++)
      for (int c = 0; c < cols; c++) nk_tile(x + m * ldx, ldx, w + c * ldw, ldw, K, 1, 1, dots + m * cols + c);
}

/* y [M, N] = x [M, K] @ w[N, K].T + bias [N] (or NULL); K a multiple of 8. */
void float_linear_nk(const float* x, ptrdiff_t ldx, const float* w, ptrdiff_t ldw, const float* bias, float* y,
                     int M, int N, int K, int threads)
{
  const int wide = M == 1 ? 8 : 4, tiles = (N + wide - 1) / wide;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < tiles; t++) {
    const int n0 = t * wide, cols = N - n0 < wide ? N - n0 : wide;
    float dots[3 * 8];
    for (int m0 = 0; m0 < M; m0 += 3) {
      const int rows = M - m0 < 3 ? M - m0 : 3;
      nk_block(x + m0 * ldx, ldx, w + n0 * ldw, ldw, K, rows, cols, dots);
      for (int m = 0; m < rows; m++)
        for (int c = 0; c < cols; c++)
          y[(size_t)(m0 + m) * N + n0 + c] = dots[m * cols + c] + (bias ? bias[n0 + c] : 0.f);
    }
  }
}
