/* The small per-layer steps of a float32 forward, one call each instead of 4-10 PyTorch ops
 * (at one token per sequence, per-op overhead, not arithmetic, is what they cost).
 *
 *   add_rms_norm:  residual += x (optional); out = residual / max(|residual|, min_norm) * w
 *   rope_store_kv: rotate q and k heads in place (rotate-half layout), store k and v rows
 *   decode_attention: one query per sequence against its paged K/V, grouped-query heads
 *
 * Threads: OpenMP (PyTorch's runtime) over rows / (sequence, kv head) pairs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

void add_rms_norm(float *x, float *residual, const float *w, float *out, int64_t rows, int64_t dim,
                  float min_norm, _Bool add) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * dim;
        const float *xr = x + r * dim;
        float ss = 0.f;
        if (add) {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) {
                float v = res[i] + xr[i];
                res[i] = v;
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += res[i] * res[i];
        }
        float norm = sqrtf(ss);
        float inv = 1.f / (norm > min_norm ? norm : min_norm);
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = res[i] * inv * w[i];
    }
}

/* qkv: [T, row_stride] floats, q heads then k heads then v heads, head_dim d each.
 * cos/sin: [T, d] = [cos | cos] and [-sin | sin]. cache: [2, slots, kv_heads, d]. */
void rope_store_kv(float *qkv, int64_t tokens, int64_t row_stride, int64_t q_heads,
                   int64_t kv_heads, int64_t d, const float *cos, const float *sin, float *cache,
                   int64_t cache_slots, const int64_t *slots) {
    const int64_t half = d / 2, rot_heads = q_heads + kv_heads;
#pragma omp parallel for schedule(static) if (tokens > 16)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < rot_heads; h++) {
            float *x = row + h * d;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                /* the products and sums round like HF's x * cos + rotate_half(x) * sin */
                x[i] = x1 * c[i] + x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        const int64_t kv_bytes = kv_heads * d * (int64_t)sizeof(float);
        memcpy(cache + slots[t] * kv_heads * d, row + q_heads * d, kv_bytes);
        memcpy(cache + (cache_slots + slots[t]) * kv_heads * d, row + rot_heads * d, kv_bytes);
    }
}

/* q: [B, q_stride] (q heads first), out: [B, q_heads * d]. Sequence b sees key positions
 * max(0, len - window) .. len - 1 (window <= 0: all) of its blocks in block_tables[b], then
 * (a draft tree's node) the cache slots extra_slots[b * max_extra ..] that are >= 0: its
 * ancestors and itself, stored past its context (extra_slots NULL: none). */
void decode_attention(const float *q, int64_t batch, int64_t q_stride, int64_t q_heads,
                      int64_t kv_heads, int64_t d, const float *cache, int64_t cache_slots,
                      int64_t block_size, const int64_t *block_tables, int64_t table_width,
                      const int64_t *seq_lens, float scale, int64_t window, float *out,
                      float *scratch /* [B * kv_heads][max_len + max_extra] */, int64_t max_len,
                      const int64_t *extra_slots, int64_t max_extra) {
    const int64_t group = q_heads / kv_heads, extras = extra_slots ? max_extra : 0;
    const int64_t stride = max_len + extras;
#pragma omp parallel for schedule(static) collapse(2) if (batch * kv_heads > 1)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t len = seq_lens[b];
            const int64_t first = window > 0 && len > window ? len - window : 0;
            const int64_t *table = block_tables + b * table_width;
            const int64_t *extra = extras ? extra_slots + b * extras : 0;
            float *scores = scratch + (b * kv_heads + g) * stride;
            for (int64_t j = 0; j < group; j++) {
                const float *qh = q + b * q_stride + (g * group + j) * d;
                float *o = out + b * q_heads * d + (g * group + j) * d;
                float top = -INFINITY;
                for (int64_t p = first; p < len; p++) {
                    int64_t slot = table[p / block_size] * block_size + p % block_size;
                    const float *k = cache + (slot * kv_heads + g) * d;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < d; i++) dot += qh[i] * k[i];
                    dot *= scale;
                    scores[p] = dot;
                    top = dot > top ? dot : top;
                }
                for (int64_t e = 0; e < extras && extra[e] >= 0; e++) {
                    const float *k = cache + (extra[e] * kv_heads + g) * d;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < d; i++) dot += qh[i] * k[i];
                    dot *= scale;
                    scores[max_len + e] = dot;
                    top = dot > top ? dot : top;
                }
                float total = 0.f;
                for (int64_t p = first; p < len; p++) {
                    float e = expf(scores[p] - top);
                    scores[p] = e;
                    total += e;
                }
                for (int64_t e = 0; e < extras && extra[e] >= 0; e++) {
                    float x = expf(scores[max_len + e] - top);
                    scores[max_len + e] = x;
                    total += x;
                }
                for (int64_t i = 0; i < d; i++) o[i] = 0.f;
                for (int64_t p = first; p < len; p++) {
                    int64_t slot = table[p / block_size] * block_size + p % block_size;
                    const float *v = cache + ((cache_slots + slot) * kv_heads + g) * d;
                    float wgt = scores[p] / total;
#pragma omp simd
                    for (int64_t i = 0; i < d; i++) o[i] += wgt * v[i];
                }
                for (int64_t e = 0; e < extras && extra[e] >= 0; e++) {
                    const float *v = cache + ((cache_slots + extra[e]) * kv_heads + g) * d;
                    float wgt = scores[max_len + e] / total;
#pragma omp simd
                    for (int64_t i = 0; i < d; i++) o[i] += wgt * v[i];
                }
            }
        }
    }
}
