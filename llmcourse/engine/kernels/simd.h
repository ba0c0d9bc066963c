/* Helpers the CPU kernels share (x86-64, AVX2). */

#ifndef LLMCOURSE_SIMD_H
#define LLMCOURSE_SIMD_H

#include <immintrin.h>

/* The sum of a vector's 8 floats, always added in the same order (lanes 0+4, 1+5, ..., then pairs). */
static inline float sum8(__m256 v)
{
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
}

#endif
