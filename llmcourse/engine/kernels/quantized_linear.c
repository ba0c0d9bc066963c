/* int4 x int8 and int8 x int8 matrix-vector products for the CPU (x86-64 with AVX2, F16C and FMA), called by
   llmcourse.engine.cpu_kernels.

   Weights: llmcourse's int4 format (Q4_0-style): rows of K values in groups of 32, two 4-bit two's-complement
   values per byte (value 2j in the low nibble of byte j), one float16 scale per group.
   Activations: each row quantized to int8 with its own scale (absmax / 127), exactly as
   llmcourse.engine.quantize.quantize_int8 does, and laid out in the order the nibbles come out of the weights' bytes:
   for each pair of groups (2p, 2p + 1), 32 bytes of packed weights hold group 2p's 16 bytes then group 2p + 1's,
   so the activations are stored as the 16 even-indexed values of group 2p, the 16 even-indexed of 2p + 1 (the
   low nibbles), then the 16 odd-indexed of 2p and of 2p + 1 (the high nibbles). A last unpaired group is
   stored as its 16 even-indexed values then its 16 odd-indexed ones.
   Each group's 32 products are summed exactly in integers, then scaled: a row's result does not depend on
   the other rows, nor on how the rows are split between threads. The dot product is llama.cpp's for Q4_0. */

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "simd.h"


/* xq[m] = round(x[m] / s[m]) with s[m] = max|x[m]| / 127 (the division, not a multiplication by 1 / s, to round
   exactly as torch does). With `group_sums` (the int4 kernel's input): each group in the order described above,
   and group_sums[m, g] = 8 * (the sum of the group's values). */
void quantize_rows(const float* x, int M, int K, int8_t* xq, float* xs, int32_t* group_sums)
{
  for (int m = 0; m < M; m++) {
    const float* row = x + (size_t)m * K;
    float amax = 0.f;
    for (int k = 0; k < K; k++) {
      float a = fabsf(row[k]);
      amax = a > amax ? a : amax;
    }
    float s = amax / 127.f, d = s > 0.f ? s : 1.f; /* an all-zero row: scale 0, values 0 */
    xs[m] = s;
    int8_t* out = xq + (size_t)m * K;
    if (!group_sums) {
      for (int k = 0; k < K; k++) out[k] = (int8_t)__builtin_roundevenf(row[k] / d);
      continue;
    }
    const int G = K / 32;
    for (int g = 0; g < G; g++) {
      int32_t sum = 0;
      int8_t* even = out + (g % 2 == 0 && g + 1 == G ? 32 * g : 64 * (g / 2) + 16 * (g % 2));
      int8_t* odd = even + (g % 2 == 0 && g + 1 == G ? 16 : 32);
      for (int j = 0; j < 16; j++) {
        even[j] = (int8_t)__builtin_roundevenf(row[32 * g + 2 * j] / d);
        odd[j] = (int8_t)__builtin_roundevenf(row[32 * g + 2 * j + 1] / d);
        sum += even[j] + odd[j];
      }
      group_sums[(size_t)m * G + g] = 8 * sum;
    }
  }
}

/* The nibble n of a value w in [-8, 7] (two's complement) is turned into the unsigned w + 8 = n ^ 8, which maddubs
   can multiply by signed bytes; the activations' group sums (8 * sum(x)) take the extra 8x back off. */

/* The weights w + 8 of groups g and g + 1 (32 bytes, in 64 after unpacking): lane 0 even-indexed values of g, lane 1
   of g + 1; then the odd-indexed ones. */
static inline void unpack_pair(const uint8_t* row, int g, __m256i* even, __m256i* odd)
{
  const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  __m256i b = _mm256_loadu_si256((const __m256i*)(row + 16 * g));
  *even = _mm256_xor_si256(_mm256_and_si256(b, low4), eight);
  *odd = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4), eight);
}

/* A last unpaired group g: its weights w + 8, even-indexed values then odd-indexed ones. */
static inline __m256i unpack_group(const uint8_t* row, int g)
{
  const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  __m128i b = _mm_loadu_si128((const __m128i*)(row + 16 * g));
  return _mm256_xor_si256(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4), eight);
}

/* Groups g and g + 1: lane 0 holds 4 exact int32 partial sums of group g, lane 1 of g + 1. The weights come from the
   packed row, or, unpacked once for many input rows, from `w` (same layout as the activations). */
static inline __m256i pair_dot(const uint8_t* row, const uint8_t* w, const int8_t* x, int g)
{
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i even, odd;
  if (w) {
    even = _mm256_loadu_si256((const __m256i*)(w + 32 * g));
    odd = _mm256_loadu_si256((const __m256i*)(w + 32 * g + 32));
  } else {
    unpack_pair(row, g, &even, &odd);
  }
  __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_loadu_si256((const __m256i*)(x + 32 * g))),
                                   _mm256_maddubs_epi16(odd, _mm256_loadu_si256((const __m256i*)(x + 32 * g + 32))));
  return _mm256_madd_epi16(pairs, ones); /* |sums| <= 4 * 15 * 127: no int16 overflow above */
}

/* A last unpaired group g: 8 exact int32 partial sums. */
static inline __m256i group_dot(const uint8_t* row, const uint8_t* w, const int8_t* x, int g)
{
  __m256i v = w ? _mm256_loadu_si256((const __m256i*)(w + 32 * g)) : unpack_group(row, g);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i*)(x + 32 * g))), _mm256_set1_epi16(1));
}

static inline int32_t sum4(__m128i v)
{
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}

/* y[m, n] = xs[m] * sum_g scale[n, g] * sum_i xq[m, 32g + i] w[n, 32g + i] + bias[n] */
/* One output: xs * sum_g scale[g] * sum_i x[32g + i] w[32g + i] */
static inline float int4_dot(const uint8_t* row, const uint8_t* w, const uint16_t* srow, const int8_t* x,
                             const int32_t* xsum, int G)
{
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 acc = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= G; g += 8) { /* eight groups' sums gathered in one vector, scaled by eight scales at once */
    __m256i h01 = _mm256_hadd_epi32(pair_dot(row, w, x, g), pair_dot(row, w, x, g + 2));     /* g0 g0 g2 g2 | g1 g1 g3 g3 */
    __m256i h23 = _mm256_hadd_epi32(pair_dot(row, w, x, g + 4), pair_dot(row, w, x, g + 6)); /* g4 g4 g6 g6 | g5 g5 g7 g7 */
    __m256i sums = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h01, h23), order);          /* g0 g1 ... g7 */
    sums = _mm256_sub_epi32(sums, _mm256_loadu_si256((const __m256i*)(xsum + g)));
    __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(srow + g)));
    acc = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sums), acc);
  }
  if (g + 4 <= G) { /* four groups the same way, in half a vector (rows of 192 values have six groups) */
    __m256i h = _mm256_hadd_epi32(pair_dot(row, w, x, g), pair_dot(row, w, x, g + 2)); /* g0 g0 g2 g2 | g1 g1 g3 g3 */
    __m128i sums = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h, h), order)); /* g0 .. g3 */
    sums = _mm_sub_epi32(sums, _mm_loadu_si128((const __m128i*)(xsum + g)));
    __m128 s = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(srow + g)));
    acc = _mm256_add_ps(acc, _mm256_castps128_ps256(_mm_mul_ps(s, _mm_cvtepi32_ps(sums))));
    g += 4;
  }
  float tail = 0.f;
  for (; g + 2 <= G; g += 2) {
    __m256i d = pair_dot(row, w, x, g);
    tail += _cvtsh_ss(srow[g]) * (float)(sum4(_mm256_castsi256_si128(d)) - xsum[g]);
    tail += _cvtsh_ss(srow[g + 1]) * (float)(sum4(_mm256_extracti128_si256(d, 1)) - xsum[g + 1]);
  }
  if (g < G) {
    __m256i d = group_dot(row, w, x, g);
    tail += _cvtsh_ss(srow[g]) * (float)(sum4(_mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1))) - xsum[g]);
  }
  return sum8(acc) + tail;
}

/* What the products of a job read: the weights, the activations and the output. */
struct quantized_job {
  const void* weight;
  const void* scales;
  const int8_t* xq;
  const uint8_t* xu;
  const int32_t* group_sums;
  const float *xs, *bias;
  float* y;
  int M, N, K, rows_per_chunk;
};

/* y[m, n] = xs[m] * sum_g scale[n, g] * sum_i xq[m, 32g + i] w[n, 32g + i] + bias[n]. With several input rows,
   each row of weights is unpacked once into `w` (K bytes) and used for all of them. */
static void int4_chunk(const void* args, int chunk)
{
  const struct quantized_job* j = args;
  const int M = j->M, N = j->N, K = j->K, G = K / 32, first = chunk * j->rows_per_chunk;
  const int last = first + j->rows_per_chunk < N ? first + j->rows_per_chunk : N;
  uint8_t* w = M > 1 ? malloc(K) : NULL;
  for (int n = first; n < last; n++) {
    const uint8_t* row = (const uint8_t*)j->weight + (size_t)n * (K / 2);
    if (w) {
      int g = 0;
      for (; g + 2 <= G; g += 2) {
        __m256i even, odd;
        unpack_pair(row, g, &even, &odd);
        _mm256_storeu_si256((__m256i*)(w + 32 * g), even);
        _mm256_storeu_si256((__m256i*)(w + 32 * g + 32), odd);
      }
      if (g < G) _mm256_storeu_si256((__m256i*)(w + 32 * g), unpack_group(row, g));
    }
    for (int m = 0; m < M; m++) {
      float dot = int4_dot(row, w, (const uint16_t*)j->scales + (size_t)n * G, j->xq + (size_t)m * K,
                           j->group_sums + (size_t)m * G, G);
      j->y[(size_t)m * N + n] = dot * j->xs[m] + (j->bias ? j->bias[n] : 0.f);
    }
  }
  free(w);
}

/* int8 weights w [N, K] with a scale per row, activations in natural order (quantize_rows with grouped = 0):
   y[m, n] = float(sum_k xq[m, k] w[n, k]) * (xs[m] * scale[n]), the integer sum exact (|sum| < 127 * 127 * K),
   so the result equals torch._int_mm's scaled the same way. */
static void int8_chunk(const void* args, int chunk)
{
  const struct quantized_job* j = args;
  const int M = j->M, N = j->N, K = j->K, first = chunk * j->rows_per_chunk;
  const int last = first + j->rows_per_chunk < N ? first + j->rows_per_chunk : N;
  const __m256i ones = _mm256_set1_epi16(1);
  const float* scales = j->scales;
  for (int n = first; n < last; n++) {
    const int8_t* row = (const int8_t*)j->weight + (size_t)n * K;
    for (int m = 0; m < M; m++) {
      const int8_t* x = j->xq + (size_t)m * K;
      __m256i acc = _mm256_setzero_si256();
      for (int k = 0; k < K; k += 32) {
        __m256i w = _mm256_loadu_si256((const __m256i*)(row + k)), v = _mm256_loadu_si256((const __m256i*)(x + k));
        __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      j->y[(size_t)m * N + n] = (float)_mm_cvtsi128_si32(s4) * (j->xs[m] * scales[n]) + (j->bias ? j->bias[n] : 0.f);
    }
  }
}

/* The same product on CPUs with AVX-512 VNNI, whose vpdpbusd multiplies 32 unsigned by 32 signed bytes and adds
   them to 8 int32 sums in one instruction (maddubs, madd and add above). The activations are made unsigned,
   xq + 128 (xor 0x80), and 128 * sum_k w[n, k] is taken back off: the same exact integer sum, so the same result.
   A tile of 4 weight rows x 3 input rows: each weight loaded once for three rows, 12 sums in registers. */
#define VNNI __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))

VNNI static inline int32_t sum8_epi32(__m256i v)
{
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

VNNI static inline __attribute__((always_inline)) void int8_tile_vnni(const int8_t* w, const uint8_t* xu, int K,
                                                                       int rows, int cols, int32_t* sums)
{
  __m256i acc[3][4];
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < cols; c++) acc[m][c] = _mm256_setzero_si256();
  for (int k = 0; k < K; k += 32) {
    __m256i wv[4];
    for (int c = 0; c < cols; c++) wv[c] = _mm256_loadu_si256((const __m256i*)(w + (size_t)c * K + k));
    for (int m = 0; m < rows; m++) {
      __m256i x = _mm256_loadu_si256((const __m256i*)(xu + (size_t)m * K + k));
      for (int c = 0; c < cols; c++) acc[m][c] = _mm256_dpbusd_epi32(acc[m][c], x, wv[c]);
    }
  }
  for (int m = 0; m < rows; m++)
    for (int c = 0; c < cols; c++) sums[m * 4 + c] = sum8_epi32(acc[m][c]);
}

VNNI static void int8_chunk_vnni(const void* args, int chunk)
{
  const struct quantized_job* j = args;
  const int M = j->M, N = j->N, K = j->K, first = chunk * j->rows_per_chunk;
  const int last = first + j->rows_per_chunk < N ? first + j->rows_per_chunk : N;
  const float* scales = j->scales;
  for (int n0 = first; n0 < last; n0 += 4) {
    const int cols = last - n0 < 4 ? last - n0 : 4;
    const int8_t* w = (const int8_t*)j->weight + (size_t)n0 * K;
    int32_t wsum[4], sums[12];
    const __m256i ones = _mm256_set1_epi8(1);
    for (int c = 0; c < cols; c++) { /* 128 * sum_k w[n, k], what the unsigned activations add */
      __m256i a = _mm256_setzero_si256();
      for (int k = 0; k < K; k += 32) a = _mm256_dpbusd_epi32(a, ones, _mm256_loadu_si256((const __m256i*)(w + (size_t)c * K + k)));
      wsum[c] = 128 * sum8_epi32(a);
    }
    for (int m0 = 0; m0 < M; m0 += 3) {
      const int rows = M - m0 < 3 ? M - m0 : 3;
      const uint8_t* x = j->xu + (size_t)m0 * K;
      if (rows == 3 && cols == 4) int8_tile_vnni(w, x, K, 3, 4, sums);
      else if (rows == 1 && cols == 4) int8_tile_vnni(w, x, K, 1, 4, sums);
      else if (rows == 2 && cols == 4) int8_tile_vnni(w, x, K, 2, 4, sums);
      else
        for (int m = 0; m < rows; m++)
          for (int c = 0; c < cols; c++) {
            int32_t one;
            int8_tile_vnni(w + (size_t)c * K, x + (size_t)m * K, K, 1, 1, &one);
            sums[m * 4 + c] = one;
          }
      for (int m = 0; m < rows; m++)
        for (int c = 0; c < cols; c++)
          j->y[(size_t)(m0 + m) * N + n0 + c] =
              (float)(sums[m * 4 + c] - wsum[c]) * (j->xs[m0 + m] * scales[n0 + c]) + (j->bias ? j->bias[n0 + c] : 0.f);
    }
  }
}

/* y [M, N] = x [M, K] (float32) times int4 weights [N, K], plus bias [N] (or NULL). */
void int4_linear(const float* x, const uint8_t* packed, const uint16_t* scales, const float* bias, float* y,
                 int M, int N, int K, int threads)
{
  int8_t* xq = malloc((size_t)M * K);
  float* xs = malloc(sizeof(float) * M);
  int32_t* sums = malloc(sizeof(int32_t) * M * (K / 32));
  quantize_rows(x, M, K, xq, xs, sums);
  struct quantized_job job = {packed, scales, xq, NULL, sums, xs, bias, y, M, N, K, pool_chunk_units(N, K / 2, 1)};
  pool_run(threads, (N + job.rows_per_chunk - 1) / job.rows_per_chunk, int4_chunk, &job);
  free(xq), free(xs), free(sums);
}

/* y [M, N] = x [M, K] (float32) times int8 weights [N, K], plus bias [N] (or NULL). */
void int8_linear(const float* x, const int8_t* weight, const float* scales, const float* bias, float* y,
                 int M, int N, int K, int threads)
{
  int8_t* xq = malloc((size_t)M * K);
  float* xs = malloc(sizeof(float) * M);
  quantize_rows(x, M, K, xq, xs, NULL);
  struct quantized_job job = {weight, scales, xq, NULL, NULL, xs, bias, y, M, N, K, 0};
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) {
    uint8_t* xu = malloc((size_t)M * K); /* the activations made unsigned for vpdpbusd */
    for (size_t i = 0; i < (size_t)M * K; i++) xu[i] = (uint8_t)xq[i] ^ 0x80;
    job.xu = xu, job.rows_per_chunk = pool_chunk_units(N, K, 4);
    pool_run(threads, (N + job.rows_per_chunk - 1) / job.rows_per_chunk, int8_chunk_vnni, &job);
    free(xu);
  } else {
    job.rows_per_chunk = pool_chunk_units(N, K, 1);
    pool_run(threads, (N + job.rows_per_chunk - 1) / job.rows_per_chunk, int8_chunk, &job);
  }
  free(xq), free(xs);
}

/* The int4 weights [N, K] as float32, each group of 32 in the kernel's order (its even-indexed values, then its
   odd-indexed ones): out[n, 32g + j] = scale[n, g] * w[n, 32g + 2j], out[n, 32g + 16 + j] = scale[n, g] * w[n, 32g + 2j + 1].
   For many rows (prefill), multiplying rows reordered the same way by this matrix costs less than the kernel above. */
static void dequantize_chunk(const void* args, int chunk)
{
  const struct quantized_job* j = args;
  const int N = j->N, K = j->K, G = K / 32, first = chunk * j->rows_per_chunk;
  const int last = first + j->rows_per_chunk < N ? first + j->rows_per_chunk : N;
  const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  for (int n = first; n < last; n++)
    for (int g = 0; g < G; g++) {
      __m128i b = _mm_loadu_si128((const __m128i*)((const uint8_t*)j->weight + (size_t)n * (K / 2) + 16 * g));
      __m256 s = _mm256_set1_ps(_cvtsh_ss(((const uint16_t*)j->scales)[(size_t)n * G + g]));
      float* o = j->y + (size_t)n * K + 32 * g;
      for (int half = 0; half < 2; half++) {
        __m128i w = _mm_and_si128(half ? _mm_srli_epi16(b, 4) : b, low4);
        w = _mm_sub_epi8(_mm_xor_si128(w, eight), eight); /* 16 values -8..7 */
        _mm256_storeu_ps(o + 16 * half, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w))));
        _mm256_storeu_ps(o + 16 * half + 8, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(w, 8)))));
      }
    }
}

void int4_dequantize(const uint8_t* packed, const uint16_t* scales, float* out, int N, int K, int threads)
{
  struct quantized_job job = {packed, scales, NULL, NULL, NULL, NULL, NULL, out, 0, N, K, pool_chunk_units(N, K / 2, 1)};
  pool_run(threads, (N + job.rows_per_chunk - 1) / job.rows_per_chunk, dequantize_chunk, &job);
}
