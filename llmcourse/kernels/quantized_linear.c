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

/* xq[m] = round(x[m] / s[m]) with s[m] = max|x[m]| / 127; in the group order described above if `grouped`. */
void quantize_rows(const float* x, int M, int K, int8_t* xq, float* xs, int grouped)
{
  for (int m = 0; m < M; m++) {
    const float* row = x + (size_t)m * K;
    float amax = 0.f;
    for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
    float s = amax / 127.f, d = s > 0.f ? s : 1.17549435e-38f; /* an all-zero row: scale 0, values 0 */
    xs[m] = s;
    int8_t* out = xq + (size_t)m * K;
    for (int k = 0; k < K; k++) {
      int g = k / 32, i = k % 32;
      out[grouped ? 32 * g + (i % 2) * 16 + i / 2 : k] = (int8_t)__builtin_roundevenf(row[k] / d);
    }
  }
}

/* y[m, n] = xs[m] * sum_g scale[n, g] * sum_i xq[m, 32g + i] w[n, 32g + i] */
void int4_linear(const uint8_t* packed, const uint16_t* scales, const int8_t* xq, const float* xs, float* y,
                 int M, int N, int K, int threads)
{
  const int G = K / 32;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int n = 0; n < N; n++) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
    const uint8_t* row = packed + (size_t)n * (K / 2);
    const uint16_t* srow = scales + (size_t)n * G;
    for (int m = 0; m < M; m++) {
      const int8_t* x = xq + (size_t)m * K;
      __m256 acc = _mm256_setzero_ps();
      for (int g = 0; g < G; g++) {
        __m128i b = _mm_loadu_si128((const __m128i*)(row + 16 * g));
        __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4); /* nibbles 0..15 */
        w = _mm256_sub_epi8(_mm256_xor_si256(w, eight), eight);                         /* -8..7 */
        __m256i v = _mm256_loadu_si256((const __m256i*)(x + 32 * g));
        /* maddubs multiplies unsigned by signed bytes: |w| times x with w's sign */
        __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
        __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)); /* 8 exact partial sums */
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(srow[g])), sums, acc);
      }
      __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
      y[(size_t)m * N + n] = _mm_cvtss_f32(s4) * xs[m];
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
