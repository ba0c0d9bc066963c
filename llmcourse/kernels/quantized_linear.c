/* int4 x int8 and int8 x int8 matrix-vector products for the CPU (x86-64 with AVX2, F16C and FMA), called by
   llmcourse.cpu_kernels.

   Weights: llmcourse's int4 format (Q4_0-style): rows of K values in groups of 32, two 4-bit two's-complement
   values per byte (value 2j in the low nibble of byte j), one float16 scale per group.
   Activations: each row quantized to int8 with its own scale (absmax / 127), exactly as
   llmcourse.quantize.quantize_int8 does, and each group of 32 stored as its 16 even-indexed values then its
   16 odd-indexed ones: the order in which the nibbles come out of 16 bytes (low nibbles, then high).
   Each group's 32 products are summed exactly in integers, then scaled: a row's result does not depend on
   the other rows, nor on how the rows are split between threads. The dot product is llama.cpp's for Q4_0. */

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

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
    for (int g = 0; g < K / 32; g++) {
      int32_t sum = 0;
      for (int j = 0; j < 16; j++) {
        int8_t even = (int8_t)__builtin_roundevenf(row[32 * g + 2 * j] / d);
        int8_t odd = (int8_t)__builtin_roundevenf(row[32 * g + 2 * j + 1] / d);
        out[32 * g + j] = even;
        out[32 * g + 16 + j] = odd;
        sum += even + odd;
      }
      group_sums[(size_t)m * (K / 32) + g] = 8 * sum;
    }
  }
}

/* The 32 products of group g of a row of weights and of activations, plus 8 times the sum of the activations, as 8
   exact int32 partial sums. The nibble n of a value w in [-8, 7] (two's complement) is turned into the unsigned
   w + 8 = n ^ 8, which maddubs can multiply by signed bytes; group_sums takes the 8 * sum(x) back off. */
static inline __m256i group_dot(const uint8_t* row, const int8_t* x, int g)
{
  const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
  __m128i b = _mm_loadu_si128((const __m128i*)(row + 16 * g));
  __m256i w = _mm256_xor_si256(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4), eight); /* w + 8 */
  __m256i v = _mm256_loadu_si256((const __m256i*)(x + 32 * g));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, v), ones);
}

static inline float sum8(__m256 v)
{
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
}

/* y[m, n] = xs[m] * sum_g scale[n, g] * sum_i xq[m, 32g + i] w[n, 32g + i] */
void int4_linear(const uint8_t* packed, const uint16_t* scales, const int8_t* xq, const int32_t* group_sums,
                 const float* xs, float* y, int M, int N, int K, int threads)
{
  const int G = K / 32;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int n = 0; n < N; n++) {
    const uint8_t* row = packed + (size_t)n * (K / 2);
    const uint16_t* srow = scales + (size_t)n * G;
    for (int m = 0; m < M; m++) {
      const int8_t* x = xq + (size_t)m * K;
      const int32_t* xsum = group_sums + (size_t)m * G;
      __m256 acc = _mm256_setzero_ps();
      int g = 0;
      for (; g + 8 <= G; g += 8) { /* eight groups' sums gathered in one vector, scaled by eight scales at once */
        __m256i h01 = _mm256_hadd_epi32(group_dot(row, x, g), group_dot(row, x, g + 1));
        __m256i h23 = _mm256_hadd_epi32(group_dot(row, x, g + 2), group_dot(row, x, g + 3));
        __m256i h45 = _mm256_hadd_epi32(group_dot(row, x, g + 4), group_dot(row, x, g + 5));
        __m256i h67 = _mm256_hadd_epi32(group_dot(row, x, g + 6), group_dot(row, x, g + 7));
        __m256i h03 = _mm256_hadd_epi32(h01, h23), h47 = _mm256_hadd_epi32(h45, h67); /* halves of groups 0-3, 4-7 */
        __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20), _mm256_permute2x128_si256(h03, h47, 0x31));
        sums = _mm256_sub_epi32(sums, _mm256_loadu_si256((const __m256i*)(xsum + g)));
        __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(srow + g)));
        acc = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sums), acc);
      }
      float tail = 0.f;
      for (; g < G; g++) {
        __m256i d = group_dot(row, x, g);
        __m128i d4 = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
        d4 = _mm_add_epi32(d4, _mm_shuffle_epi32(d4, 0x4E));
        d4 = _mm_add_epi32(d4, _mm_shuffle_epi32(d4, 0xB1));
        tail += _cvtsh_ss(srow[g]) * (float)(_mm_cvtsi128_si32(d4) - xsum[g]);
      }
      y[(size_t)m * N + n] = (sum8(acc) + tail) * xs[m];
    }
  }
}

/* int8 weights w [N, K] with a scale per row, activations in natural order (quantize_rows with grouped = 0):
   y[m, n] = float(sum_k xq[m, k] w[n, k]) * (xs[m] * scale[n]), the integer sum exact (|sum| < 127 * 127 * K),
   so the result equals torch._int_mm's scaled the same way. */
void int8_linear(const int8_t* weight, const float* scales, const int8_t* xq, const float* xs, float* y,
                 int M, int N, int K, int threads)
{
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int n = 0; n < N; n++) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* row = weight + (size_t)n * K;
    for (int m = 0; m < M; m++) {
      const int8_t* x = xq + (size_t)m * K;
      __m256i acc = _mm256_setzero_si256();
      for (int k = 0; k < K; k += 32) {
        __m256i w = _mm256_loadu_si256((const __m256i*)(row + k)), v = _mm256_loadu_si256((const __m256i*)(x + k));
        __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      y[(size_t)m * N + n] = (float)_mm_cvtsi128_si32(s4) * (xs[m] * scales[n]);
    }
  }
}

/* The int4 weights [N, K] as float32, each group of 32 in the kernel's order (its even-indexed values, then its
   odd-indexed ones): out[n, 32g + j] = scale[n, g] * w[n, 32g + 2j], out[n, 32g + 16 + j] = scale[n, g] * w[n, 32g + 2j + 1].
   For many rows (prefill), multiplying rows reordered the same way by this matrix costs less than the kernel above. */
void int4_dequantize(const uint8_t* packed, const uint16_t* scales, float* out, int N, int K, int threads)
{
  const int G = K / 32;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int n = 0; n < N; n++) {
    const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    for (int g = 0; g < G; g++) {
      __m128i b = _mm_loadu_si128((const __m128i*)(packed + (size_t)n * (K / 2) + 16 * g));
      __m256 s = _mm256_set1_ps(_cvtsh_ss(scales[(size_t)n * G + g]));
      float* o = out + (size_t)n * K + 32 * g;
      for (int half = 0; half < 2; half++) {
        __m128i w = _mm_and_si128(half ? _mm_srli_epi16(b, 4) : b, low4);
        w = _mm_sub_epi8(_mm_xor_si128(w, eight), eight); /* 16 values -8..7 */
        _mm256_storeu_ps(o + 16 * half, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w))));
        _mm256_storeu_ps(o + 16 * half + 8, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(w, 8)))));
      }
    }
  }
}
