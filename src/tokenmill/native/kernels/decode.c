/* The small per-layer steps of a float32 forward, one call each instead of 4-10 PyTorch ops
 * (at one token per sequence, per-op overhead, not arithmetic, is what they cost).
 *
 *   add_rms_norm:  residual += x (optional); out = residual / max(|residual|, min_norm) * w
 *   rope_store_kv: rotate q and k heads in place (rotate-half layout), store k and v rows
 *   decode_attention: one query per sequence against its paged K/V, grouped-query heads
 *
 * Threads: pool_for (pool.c) over rows / (sequence, kv head) pairs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*pool_fn)(void *ctx, int64_t lo, int64_t hi);
void pool_for(int64_t n, int64_t grain, pool_fn fn, void *ctx); /* pool.c */

typedef struct {
    float *x, *residual, *out;
    const float *w;
    int64_t dim;
    float min_norm;
    _Bool add;
} Norm;

static void norm_rows(void *ctx, int64_t lo, int64_t hi) {
    const Norm *n = ctx;
    const int64_t dim = n->dim;
    const float *w = n->w;
    for (int64_t r = lo; r < hi; r++) {
        float *res = n->residual + r * dim;
        const float *xr = n->x + r * dim;
        float ss = 0.f;
        if (n->add) {
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
        float inv = 1.f / (norm > n->min_norm ? norm : n->min_norm);
        float *o = n->out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = res[i] * inv * w[i];
    }
}

void add_rms_norm(float *x, float *residual, const float *w, float *out, int64_t rows, int64_t dim,
                  float min_norm, _Bool add) {
    Norm n = {x, residual, out, w, dim, min_norm, add};
    if (rows * dim > 65536)
        pool_for(rows, 1, norm_rows, &n);
    else
        norm_rows(&n, 0, rows);
}

typedef struct {
    float *qkv, *cache;
    int64_t row_stride, q_heads, kv_heads, d, cache_slots;
    const float *cos, *sin;
    const int64_t *slots;
} Rope;

static void rope_rows(void *ctx, int64_t lo, int64_t hi) {
    const Rope *r = ctx;
    const int64_t d = r->d, half = d / 2, q_heads = r->q_heads, kv_heads = r->kv_heads;
    const int64_t rot_heads = q_heads + kv_heads;
    for (int64_t t = lo; t < hi; t++) {
        float *row = r->qkv + t * r->row_stride;
        const float *c = r->cos + t * d, *s = r->sin + t * d;
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
        memcpy(r->cache + r->slots[t] * kv_heads * d, row + q_heads * d, kv_bytes);
        memcpy(r->cache + (r->cache_slots + r->slots[t]) * kv_heads * d, row + rot_heads * d,
               kv_bytes);
    }
}

/* qkv: [T, row_stride] floats, q heads then k heads then v heads, head_dim d each.
 * cos/sin: [T, d] = [cos | cos] and [-sin | sin]. cache: [2, slots, kv_heads, d]. */
void rope_store_kv(float *qkv, int64_t tokens, int64_t row_stride, int64_t q_heads,
                   int64_t kv_heads, int64_t d, const float *cos, const float *sin, float *cache,
                   int64_t cache_slots, const int64_t *slots) {
    Rope r = {qkv, cache, row_stride, q_heads, kv_heads, d, cache_slots, cos, sin, slots};
    if (tokens > 16)
        pool_for(tokens, 1, rope_rows, &r);
    else
        rope_rows(&r, 0, tokens);
}

typedef struct {
    const float *q, *cache;
    int64_t q_stride, q_heads, kv_heads, d, cache_slots, block_size, table_width, window,
        max_len;
    const int64_t *block_tables, *seq_lens;
    float scale;
    float *out, *scratch;
} Attention;

/* (sequence, kv head) pairs [lo, hi): i = b * kv_heads + g. */
static void attention_heads(void *ctx, int64_t lo, int64_t hi) {
    const Attention *a = ctx;
    const int64_t kv_heads = a->kv_heads, d = a->d, block_size = a->block_size;
    const int64_t group = a->q_heads / kv_heads;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t b = i / kv_heads, g = i % kv_heads;
        const int64_t len = a->seq_lens[b];
        const int64_t first = a->window > 0 && len > a->window ? len - a->window : 0;
        const int64_t *table = a->block_tables + b * a->table_width;
        float *scores = a->scratch + i * a->max_len;
        for (int64_t j = 0; j < group; j++) {
            const float *qh = a->q + b * a->q_stride + (g * group + j) * d;
            float *o = a->out + b * a->q_heads * d + (g * group + j) * d;
            float top = -INFINITY;
            for (int64_t p = first; p < len; p++) {
                int64_t slot = table[p / block_size] * block_size + p % block_size;
                const float *k = a->cache + (slot * kv_heads + g) * d;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t c = 0; c < d; c++) dot += qh[c] * k[c];
                dot *= a->scale;
                scores[p] = dot;
                top = dot > top ? dot : top;
            }
            float total = 0.f;
            for (int64_t p = first; p < len; p++) {
                float e = expf(scores[p] - top);
                scores[p] = e;
                total += e;
            }
            for (int64_t c = 0; c < d; c++) o[c] = 0.f;
            for (int64_t p = first; p < len; p++) {
                int64_t slot = table[p / block_size] * block_size + p % block_size;
                const float *v = a->cache + ((a->cache_slots + slot) * kv_heads + g) * d;
                float wgt = scores[p] / total;
#pragma omp simd
                for (int64_t c = 0; c < d; c++) o[c] += wgt * v[c];
            }
        }
    }
}

/* q: [B, q_stride] (q heads first), out: [B, q_heads * d]. Sequence b sees key positions
 * max(0, len - window) .. len - 1 (window <= 0: all) of its blocks in block_tables[b]. */
void decode_attention(const float *q, int64_t batch, int64_t q_stride, int64_t q_heads,
                      int64_t kv_heads, int64_t d, const float *cache, int64_t cache_slots,
                      int64_t block_size, const int64_t *block_tables, int64_t table_width,
                      const int64_t *seq_lens, float scale, int64_t window, float *out,
                      float *scratch /* [B * kv_heads][max_len] */, int64_t max_len) {
    Attention a = {.q = q, .cache = cache, .q_stride = q_stride, .q_heads = q_heads,
                   .kv_heads = kv_heads, .d = d, .cache_slots = cache_slots,
                   .block_size = block_size, .table_width = table_width, .window = window,
                   .max_len = max_len, .block_tables = block_tables, .seq_lens = seq_lens,
                   .scale = scale, .out = out, .scratch = scratch};
    pool_for(batch * kv_heads, 1, attention_heads, &a);
}
