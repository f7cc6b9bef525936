/* The small per-layer steps of a float32 forward, one call each instead of 4-10 PyTorch ops
 * (at one token per sequence, per-op overhead, not arithmetic, is what they cost).
 *
 *   add_rms_norm:  residual += x (optional); out = residual / sqrt(|residual|^2 + eps_sum) * w
 *                  (eps_sum = dim * eps, w = weight * sqrt(dim): HF's x * rsqrt(mean(x^2) + eps) * weight)
 *   rope_store_kv: rotate q and k heads in place (rotate-half layout), store k and v rows
 *   decode_attention: one query per sequence against its paged K/V, grouped-query heads
 *
 * Threads: OpenMP (PyTorch's runtime) over rows / (sequence, kv head) pairs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* n <= 16 floats of a row: res += x (when add), then acc += res * res lane by lane */
SIMD_INLINE vf16 add_square(float *res, const float *x, int n, _Bool add, vf16 acc) {
    vf16 v = n == 16 ? vf16_load(res) : vf16_load_n(res, n);
    if (add) {
        v = vf16_add(v, n == 16 ? vf16_load(x) : vf16_load_n(x, n));
        if (n == 16)
            vf16_store(res, v);
        else
            vf16_store_n(res, v, n);
    }
    return vf16_fmadd(v, v, acc);
}

void add_rms_norm(float *x, float *residual, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps_sum, _Bool add) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * dim;
        const float *xr = x + r * dim;
        vf16 acc = vf16_zero(); /* per lane an FMA chain over the chunks: same bits per level */
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) acc = add_square(res + i, xr + i, 16, add, acc);
        if (i < dim) acc = add_square(res + i, xr + i, (int)(dim - i), add, acc);
        float inv = 1.f / sqrtf(vf16_sum_lanes(acc) + eps_sum);
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

/* Keys per pass over q in key_scores: their accumulators stay in registers. */
#define KEY_GROUP (VF16_REGS >= 32 ? 16 : 4)

/* dst[p] = scale * (q . keys[p]) for n <= 16 keys of d floats (d % 16 == 0), rounded as
 * vf16_dot (the path for other d): per lane i a fused multiply-add chain over the 16-float
 * chunks, then the lanes added in order, 0 + l0 + l1 + ... + l15, the same bits at either
 * ISA level. The keys go across the lanes of one transposed block, so the 16 sums are 16
 * vector adds. */
static void key_scores(const float *q, const float *const *keys, int n, int64_t d, float scale,
                       float *dst) {
    vf16 acc[16];
    for (int p0 = 0; p0 < 16; p0 += KEY_GROUP) {
        vf16 a[KEY_GROUP];
#pragma GCC unroll 16
        for (int p = 0; p < KEY_GROUP; p++) a[p] = vf16_zero();
        if (p0 < n)
            for (int64_t c = 0; c < d; c += 16) {
                const vf16 qc = vf16_load(q + c);
#pragma GCC unroll 16
                for (int p = 0; p < KEY_GROUP; p++)
                    if (p0 + p < n) a[p] = vf16_fmadd(qc, vf16_load(keys[p0 + p] + c), a[p]);
            }
#pragma GCC unroll 16
        for (int p = 0; p < KEY_GROUP; p++) acc[p0 + p] = a[p];
    }
    vf16_transpose(acc);
    vf16 sum = vf16_zero();
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) sum = vf16_add(sum, acc[i]);
    vf16_store_n(dst, vf16_mul(sum, vf16_set1(scale)), n);
}

/* The cache rows (k: plane 0, v: plane 1) of sequence positions first .. len - 1 in order,
 * without a division per position. */
typedef struct {
    const int64_t *table;
    int64_t block, offset, block_size;
} SlotWalk;

static inline int64_t next_slot(SlotWalk *w) {
    int64_t slot = w->table[w->block] * w->block_size + w->offset;
    if (++w->offset == w->block_size) w->offset = 0, w->block++;
    return slot;
}

/* Prefetch the key and value rows of up to n positions from p (< len) on, advancing ``w``
 * past them: the walk over a sequence's blocks jumps, so the hardware prefetchers miss. Into
 * L2 (T1 / T2), not L1: a burst of 8 lines a position into L1 holds up the loads behind it
 * (18-29% slower attention at 4-32 sequences from memory). The first kv head's pass takes
 * the whole rows (every kv head's 64-byte lines of a slot lie together), so the passes of
 * the next heads, on the same thread as a rule, read from L2. */
static inline void prefetch_rows(SlotWalk *w, int64_t p, int64_t len, int n, const float *cache,
                                 int64_t kv_heads, int64_t g, int64_t d, int64_t cache_slots) {
    for (int i = 0; i < n && p + i < len; i++) {
        const int64_t slot = next_slot(w);
        const int64_t width = g == 0 ? kv_heads * d : d; /* floats from head g on */
        const char *k = (const char *)(cache + (slot * kv_heads + g) * d);
        const char *v = (const char *)(cache + ((cache_slots + slot) * kv_heads + g) * d);
        for (int64_t b = 0; b < width * (int64_t)sizeof(float); b += 64) {
            _mm_prefetch(k + b, _MM_HINT_T1);
            _mm_prefetch(v + b, _MM_HINT_T2);
        }
    }
}

/* For heads h < H (weights w[h] = wgt[h * wstride ..]): out[h][0 .. 16 C) = sum over
 * positions first .. len - 1, then the n_extra extra slots (weights w[h][len ..]),
 * of weight * v, one fused multiply-add per element and position in that order, as the
 * scalar loop; the H x C sums stay in registers and the heads share each v load.
 * v: the value plane (plus the kv head's and chunk's offset), `row` floats per slot. */
static inline __attribute__((always_inline)) void value_sum_n(
    const float *v, int64_t row, SlotWalk walk, int64_t first, int64_t len, const int64_t *extra,
    int64_t n_extra, const float *wgt, int64_t wstride, const int H, const int C,
    float *out, int64_t ostride) {
    vf16 acc[3][4];
    for (int h = 0; h < H; h++)
        for (int u = 0; u < C; u++) acc[h][u] = vf16_zero();
    for (int64_t p = first; p < len + n_extra; p++) {
        const int64_t slot = p < len ? next_slot(&walk) : extra[p - len];
        const float *vp = v + slot * row;
        vf16 vu[4];
        for (int u = 0; u < C; u++) vu[u] = vf16_load(vp + 16 * u);
        for (int h = 0; h < H; h++) {
            const vf16 w = vf16_set1(wgt[h * wstride + p]);
            for (int u = 0; u < C; u++) acc[h][u] = vf16_fmadd(w, vu[u], acc[h][u]);
        }
    }
    for (int h = 0; h < H; h++)
        for (int u = 0; u < C; u++) vf16_store(out + h * ostride + 16 * u, acc[h][u]);
}

/* 16-float chunks per value_sum call: the 3 x VALUE_CHUNKS sums stay in registers. */
#define VALUE_CHUNKS (VF16_REGS >= 32 ? 4 : 2)

#define VALUE_CASE(H, C)                                                                     \
    case (H) * 8 + (C):                                                                      \
        value_sum_n(v, row, walk, first, len, extra, n_extra, wgt, wstride, H, C, out,  \
                    ostride);                                                                \
        break;

static void value_sum(const float *v, int64_t row, SlotWalk walk, int64_t first, int64_t len,
                      const int64_t *extra, int64_t n_extra, const float *wgt, int64_t wstride,
                      int heads, int chunks, float *out, int64_t ostride) {
    switch (heads * 8 + chunks) {
        VALUE_CASE(1, 1) VALUE_CASE(1, 2) VALUE_CASE(1, 3) VALUE_CASE(1, 4)
        VALUE_CASE(2, 1) VALUE_CASE(2, 2) VALUE_CASE(2, 3) VALUE_CASE(2, 4)
        VALUE_CASE(3, 1) VALUE_CASE(3, 2) VALUE_CASE(3, 3) VALUE_CASE(3, 4)
    }
}

/* x[0 .. n) -> exp(x - max) / sum, in place. Lane i of the sum takes positions i, i + 16,
 * ... (vf16_exp_neg each), then vf16_sum_lanes: the same bits at either level, and a
 * position's weight depends only on the row's scores (a verify row, its draft keys past the
 * context, is laid out as the decode step of the same tokens). */
static void softmax_in_place(float *x, int64_t n) {
    vf16 vtop = vf16_set1(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) vtop = vf16_max(vtop, vf16_load(x + i));
    float lanes[16], top = -INFINITY;
    vf16_store(lanes, vtop);
    for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    const vf16 shift = vf16_set1(top);
    vf16 acc = vf16_zero();
    for (i = 0; i + 16 <= n; i += 16) {
        const vf16 e = vf16_exp_neg(vf16_sub(vf16_load(x + i), shift));
        vf16_store(x + i, e);
        acc = vf16_add(acc, e);
    }
    if (i < n) { /* the tail's unused lanes add zeros */
        const int rest = (int)(n - i);
        vf16_store_n(x + i, vf16_exp_neg(vf16_sub(vf16_load_n(x + i, rest), shift)), rest);
        acc = vf16_add(acc, vf16_load_n(x + i, rest));
    }
    const float total = vf16_sum_lanes(acc);
    for (i = 0; i < n; i++) x[i] /= total;
}

/* q: [B, q_stride] (q heads first), out: [B, q_heads * d]. Sequence b sees key positions
 * max(0, len - window) .. len - 1 (window <= 0: all) of its blocks in block_tables[b], then
 * (a draft tree's node) the cache slots extra_slots[b * max_extra ..] that are >= 0: its
 * ancestors and itself, stored past its context (extra_slots NULL: none). When d % 16 == 0
 * the scores go 16 keys at a time (key_scores; each block of keys serves every q head of
 * its kv head while in L1) and the weighted values of up to 3 heads of a group at once
 * (value_sum), with the bits of the scalar loops kept for other d; at 9 rows x 65 keys
 * that is 1.7x faster. Each row's result depends on its own inputs only, so
 * a verify step's rows equal one-token decode steps bit for bit. */
void decode_attention(const float *q, int64_t batch, int64_t q_stride, int64_t q_heads,
                      int64_t kv_heads, int64_t d, const float *cache, int64_t cache_slots,
                      int64_t block_size, const int64_t *block_tables, int64_t table_width,
                      const int64_t *seq_lens, float scale, int64_t window, float *out,
                      float *scratch /* [B * q_heads][max_len + max_extra] */, int64_t max_len,
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
            int64_t n_extra = 0;
            while (n_extra < extras && extra[n_extra] >= 0) n_extra++;
            const SlotWalk walk0 = {table, first / block_size, first % block_size, block_size};
            float *const scores0 = scratch + (b * q_heads + g * group) * stride;
            if (d % 16 == 0) {
                /* scores[first .. len) for the context, then scores[len .. len + n_extra):
                 * each block of 16 keys serves every head of the group while in L1 */
                const float *keys[16];
                SlotWalk walk = walk0, ahead = walk0;
                prefetch_rows(&ahead, first, len, 16, cache, kv_heads, g, d, cache_slots);
                for (int64_t p0 = first; p0 < len; p0 += 16) {
                    const int n = len - p0 < 16 ? (int)(len - p0) : 16;
                    prefetch_rows(&ahead, p0 + 16, len, 16, cache, kv_heads, g, d, cache_slots);
                    for (int p = 0; p < n; p++)
                        keys[p] = cache + (next_slot(&walk) * kv_heads + g) * d;
                    for (int64_t j = 0; j < group; j++)
                        key_scores(q + b * q_stride + (g * group + j) * d, keys, n, d, scale,
                                   scores0 + j * stride + p0);
                }
                for (int64_t e0 = 0; e0 < n_extra; e0 += 16) {
                    const int n = n_extra - e0 < 16 ? (int)(n_extra - e0) : 16;
                    for (int p = 0; p < n; p++)
                        keys[p] = cache + (extra[e0 + p] * kv_heads + g) * d;
                    for (int64_t j = 0; j < group; j++)
                        key_scores(q + b * q_stride + (g * group + j) * d, keys, n, d, scale,
                                   scores0 + j * stride + len + e0);
                }
                for (int64_t j = 0; j < group; j++)
                    softmax_in_place(scores0 + j * stride + first, len + n_extra - first);
            }
            for (int64_t j = 0; j < group && d % 16; j++) { /* other d: one head at a time */
                const float *qh = q + b * q_stride + (g * group + j) * d;
                float *o = out + b * q_heads * d + (g * group + j) * d;
                float *scores = scores0 + j * stride;
                SlotWalk walk = walk0;
                for (int64_t p = first; p < len; p++)
                    scores[p] = vf16_dot(qh, cache + (next_slot(&walk) * kv_heads + g) * d, d) * scale;
                for (int64_t e = 0; e < n_extra; e++)
                    scores[len + e] = vf16_dot(qh, cache + (extra[e] * kv_heads + g) * d, d) * scale;
                softmax_in_place(scores + first, len + n_extra - first);
                for (int64_t i = 0; i < d; i++) o[i] = 0.f;
                walk = walk0;
                for (int64_t p = first; p < len + n_extra; p++) {
                    const int64_t slot = p < len ? next_slot(&walk) : extra[p - len];
                    const float *v = cache + ((cache_slots + slot) * kv_heads + g) * d;
                    const float wgt = scores[p];
#pragma omp simd
                    for (int64_t i = 0; i < d; i++) o[i] += wgt * v[i];
                }
            }
            if (d % 16) continue;
            const float *v = cache + (cache_slots * kv_heads + g) * d;
            for (int64_t j = 0; j < group; j += 3) {
                const int heads = group - j < 3 ? (int)(group - j) : 3;
                const float *wgt = scratch + (b * q_heads + g * group + j) * stride;
                float *o = out + b * q_heads * d + (g * group + j) * d;
                for (int64_t c = 0; c < d; c += 16 * VALUE_CHUNKS)
                    value_sum(v + c, kv_heads * d, walk0, first, len, extra, n_extra, wgt, stride,
                              heads,
                              d - c >= 16 * VALUE_CHUNKS ? VALUE_CHUNKS : (int)(d - c) / 16,
                              o + c, d);
            }
        }
    }
}
