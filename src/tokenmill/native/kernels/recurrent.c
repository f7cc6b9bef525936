/* One decode step of the recurrent layers' scans, in place in the state pool: per
 * (sequence, head) one call does what the PyTorch reference does in 6-8 ops over the whole
 * batch plus a gather and a scatter of the states (layers/recurrent/delta_rule.py, ssd.py).
 *
 *   delta_rule_step: S <- e S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q   (Gated DeltaNet)
 *   ssd_step:        S <- e S + dt x B^T;  y = S C + D x                        (Mamba2)
 *
 * The states stay where they live: sequence b's are at slot slots[b] of the pool, and
 * keep[b] == 0 (a sequence's first token) starts them from zeros. Each (sequence, head)
 * is computed alone, in the same order whatever the batch: a token's result does not depend
 * on the other sequences of its step. Threads: OpenMP over the (sequence, head) pairs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* Columns [0, n) (n <= 16) of a delta-rule state s [dk, ld] (ld: the row stride): the two
 * sweeps over the rows stay within these columns, so the [dk, 16] block is in L1 for the
 * second. o[0 .. n) = the columns' share of S^T q. */
SIMD_INLINE void delta_columns(float *s, int64_t dk, int64_t ld, int n, const float *q,
                               const float *k, const float *v, float decay, float beta,
                               float *o) {
    const vf16 e = vf16_set1(decay);
    vf16 remembered = vf16_zero(); /* (e S)^T k */
    for (int64_t i = 0; i < dk; i++) {
        float *row = s + i * ld;
        const vf16 x = vf16_mul(n == 16 ? vf16_load(row) : vf16_load_n(row, n), e);
        if (n == 16)
            vf16_store(row, x);
        else
            vf16_store_n(row, x, n);
        remembered = vf16_fmadd(vf16_set1(k[i]), x, remembered);
    }
    const vf16 vv = n == 16 ? vf16_load(v) : vf16_load_n(v, n);
    const vf16 delta = vf16_mul(vf16_sub(vv, remembered), vf16_set1(beta));
    vf16 out = vf16_zero();
    for (int64_t i = 0; i < dk; i++) {
        float *row = s + i * ld;
        const vf16 old = n == 16 ? vf16_load(row) : vf16_load_n(row, n);
        const vf16 x = vf16_fmadd(vf16_set1(k[i]), delta, old);
        if (n == 16)
            vf16_store(row, x);
        else
            vf16_store_n(row, x, n);
        out = vf16_fmadd(vf16_set1(q[i]), x, out);
    }
    if (n == 16)
        vf16_store(o, out);
    else
        vf16_store_n(o, out, n);
}

/* q, k: [B, Hk, dk] (head h reads q/k head h / (H / Hk)); v, out: [B, H, dv]; g, beta:
 * [B, H]; states: [slots, H, dk, dv], slot i at states + i * slot_stride; slots: [B] int64;
 * keep: [B] float (0: start at 0). */
void delta_rule_step(const float *q, const float *k, const float *v, const float *g,
                     const float *beta, float *states, int64_t slot_stride, const int64_t *slots,
                     const float *keep, int64_t batch, int64_t heads, int64_t k_heads, int64_t dk,
                     int64_t dv, float *out) {
    const int64_t group = heads / k_heads, pairs = batch * heads;
#pragma omp parallel for schedule(static) if (pairs * dk * dv >= (1 << 15))
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t b = p / heads, h = p % heads;
        float *s = states + slots[b] * slot_stride + h * dk * dv;
        if (keep[b] == 0.f) memset(s, 0, (size_t)(dk * dv) * sizeof(float));
        const int64_t qk = (b * k_heads + h / group) * dk;
        const float decay = expf(g[p]);
        int64_t j = 0;
        for (; j + 16 <= dv; j += 16)
            delta_columns(s + j, dk, dv, 16, q + qk, k + qk, v + p * dv + j, decay, beta[p],
                          out + p * dv + j);
        if (j < dv)
            delta_columns(s + j, dk, dv, (int)(dv - j), q + qk, k + qk, v + p * dv + j, decay,
                          beta[p], out + p * dv + j);
    }
}

/* One row of an SSD state (n_state floats): s <- e s + xdt B; returns s . C */
SIMD_INLINE float ssd_row(float *s, int64_t n_state, float decay, float xdt, const float *bv,
                          const float *cv) {
    const vf16 e = vf16_set1(decay), xs = vf16_set1(xdt);
    vf16 acc = vf16_zero();
    int64_t i = 0;
    for (; i + 16 <= n_state; i += 16) {
        const vf16 x = vf16_fmadd(xs, vf16_load(bv + i), vf16_mul(vf16_load(s + i), e));
        vf16_store(s + i, x);
        acc = vf16_fmadd(x, vf16_load(cv + i), acc);
    }
    if (i < n_state) {
        const int n = (int)(n_state - i);
        const vf16 x = vf16_fmadd(xs, vf16_load_n(bv + i, n), vf16_mul(vf16_load_n(s + i, n), e));
        vf16_store_n(s + i, x, n);
        acc = vf16_fmadd(x, vf16_load_n(cv + i, n), acc);
    }
    return vf16_sum_lanes(acc);
}

/* x, y: [B, H, P]; dt: [B, H]; a, d: [H]; b, c: [B, G, N] (head h reads group h / (H / G));
 * states: [slots, H, P, N], slot i at states + i * slot_stride; slots: [B] int64; keep: [B]
 * float (0: start at 0). */
void ssd_step(const float *x, const float *dt, const float *a, const float *b, const float *c,
              const float *d, float *states, int64_t slot_stride, const int64_t *slots,
              const float *keep, int64_t batch, int64_t heads, int64_t groups, int64_t head_dim,
              int64_t n_state, float *y) {
    const int64_t group = heads / groups, pairs = batch * heads;
#pragma omp parallel for schedule(static) if (pairs * head_dim * n_state >= (1 << 15))
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t bi = p / heads, h = p % heads;
        float *s = states + slots[bi] * slot_stride + h * head_dim * n_state;
        if (keep[bi] == 0.f) memset(s, 0, (size_t)(head_dim * n_state) * sizeof(float));
        const int64_t bc = (bi * groups + h / group) * n_state;
        const float decay = expf(dt[p] * a[h]);
        const float *xp = x + p * head_dim;
        for (int64_t r = 0; r < head_dim; r++)
            y[p * head_dim + r] = ssd_row(s + r * n_state, n_state, decay, dt[p] * xp[r], b + bc,
                                          c + bc) + d[h] * xp[r];
    }
}
