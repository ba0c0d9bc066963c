/* Attention of one new query per sequence over its cached keys and values (a decode step), for x86-64 CPUs with
   AVX2 and FMA, called by llmcourse.engine.cpu_kernels.decode_attention.

   A decode step reads every cached key and value once: at batch 16 and 150 positions, 15 MB per GPT-2 layer,
   more than the layer's weights. torch's kernels attend head by head in small tiles and read the cache at a third
   of the memory's speed; these read each head's keys, then its values, front to back. The softmax between the two
   passes is torch's (llmcourse.engine.cpu_kernels), so its exponentials are torch's too.

   Layout: q [B, H, D] and the cache [B, H_kv, T, D] with any strides but a contiguous last dimension (D a multiple
   of 8); query head h reads key/value head h / (H / H_kv) (grouped-query attention). */

#include <immintrin.h>
#include <stddef.h>

#include "pool.h"
#include "simd.h"

struct attention_job {
  const float *q, *kv, *p;
  float* out;
  ptrdiff_t qb, qh, kb, kh, kt;
  int B, H, rep, T, D, heads_per_chunk;
  float scale;
};

static void scores_chunk(const void* args, int chunk)
{
  const struct attention_job* j = args;
  const int D = j->D, T = j->T, first = chunk * j->heads_per_chunk;
  const int last = first + j->heads_per_chunk < j->B * j->H ? first + j->heads_per_chunk : j->B * j->H;
  for (int bh = first; bh < last; bh++) {
    const int b = bh / j->H, h = bh % j->H;
    const float* qv = j->q + b * j->qb + h * j->qh;
    const float* kv = j->kv + b * j->kb + (h / j->rep) * j->kh;
    const ptrdiff_t kt = j->kt;
    float* s = j->out + (size_t)bh * T;
    int t = 0;
    for (; t + 4 <= T; t += 4) { /* four keys at a time: four sums in flight */
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int d = 0; d < 4 * D; d += 16) _mm_prefetch((const char*)(kv + (t + 8) * kt + d), _MM_HINT_T0);
      for (int d = 0; d < D; d += 8) {
        __m256 x = _mm256_loadu_ps(qv + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kv + t * kt + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kv + (t + 1) * kt + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kv + (t + 2) * kt + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kv + (t + 3) * kt + d), a3);
      }
      const float scale = j->scale;
      s[t] = scale * sum8(a0), s[t + 1] = scale * sum8(a1), s[t + 2] = scale * sum8(a2), s[t + 3] = scale * sum8(a3);
    }
    for (; t < T; t++) { /* the same sum, one key at a time */
      __m256 acc = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_loadu_ps(kv + t * kt + d), acc);
      s[t] = j->scale * sum8(acc);
    }
  }
}

/* scores [B, H, T] = scale * q . k_t */
void attention_scores(const float* q, ptrdiff_t qb, ptrdiff_t qh, const float* k, ptrdiff_t kb, ptrdiff_t kh,
                      ptrdiff_t kt, float* scores, int B, int H, int Hkv, int T, int D, float scale, int threads)
{
  struct attention_job job = {q, k, NULL, scores, qb, qh, kb, kh, kt, B, H, H / Hkv, T, D, pool_chunk_units(B * H, (size_t)T * D * sizeof(float), 1), scale};
  pool_run(threads, (B * H + job.heads_per_chunk - 1) / job.heads_per_chunk, scores_chunk, &job);
}

static void values_chunk(const void* args, int chunk)
{
  const struct attention_job* j = args;
  const int D = j->D, T = j->T, first = chunk * j->heads_per_chunk;
  const int last = first + j->heads_per_chunk < j->B * j->H ? first + j->heads_per_chunk : j->B * j->H;
  for (int bh = first; bh < last; bh++) {
    const int b = bh / j->H, h = bh % j->H;
    const float* vv = j->kv + b * j->kb + (h / j->rep) * j->kh;
    const float* pr = j->p + (size_t)bh * T;
    const ptrdiff_t vt = j->kt;
    float* o = j->out + (size_t)bh * D;
    for (int d0 = 0; d0 < D; d0 += 64) { /* 64 outputs in registers at a time */
      const int n = D - d0 < 64 ? D - d0 : 64;
      __m256 acc[8];
      for (int i = 0; i < n / 8; i++) acc[i] = _mm256_setzero_ps();
      for (int t = 0; t < T; t++) {
        __m256 w = _mm256_broadcast_ss(pr + t);
        for (int i = 0; i < n / 8; i++) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vv + t * vt + d0 + 8 * i), acc[i]);
      }
      for (int i = 0; i < n / 8; i++) _mm256_storeu_ps(o + d0 + 8 * i, acc[i]);
    }
  }
}

/* out [B, H, D] = sum_t p[b, h, t] v_t */
void attention_values(const float* p, const float* v, ptrdiff_t vb, ptrdiff_t vh, ptrdiff_t vt, float* out, int B,
                      int H, int Hkv, int T, int D, int threads)
{
  struct attention_job job = {NULL, v, p, out, 0, 0, vb, vh, vt, B, H, H / Hkv, T, D, pool_chunk_units(B * H, (size_t)T * D * sizeof(float), 1), 1.f};
  pool_run(threads, (B * H + job.heads_per_chunk - 1) / job.heads_per_chunk, values_chunk, &job);
}
