/* One Whisper decoder layer for a decode step (one new token per row), all native: layer
 * norm, fused q/k/v projection, K/V store, causal self-attention, out projection, layer
 * norm, cross-attention over the row's encoder K/V, out projection, layer norm, fc1, exact
 * GELU, fc2; the residual stream updated in place. One call per layer instead of ~30
 * PyTorch operations (tiny.en's step: 4 layers at 384 wide, where each op's dispatch and
 * OpenMP barrier cost about what its arithmetic does). Projections go through
 * dense16_gemm's float32 tiles, the kernel whisper.py's NativeLinear layers use.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

void dense16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, int kernel, int64_t N,
                  float *y);

typedef struct {
    const uint16_t *qkv, *o, *cross_q, *cross_o, *fc1, *fc2; /* float32 tiles */
    const float *qkv_b, *o_b, *cross_q_b, *cross_o_b, *fc1_b, *fc2_b; /* biases (k's: 0) */
    const float *ln1_w, *ln1_b, *ln2_w, *ln2_b, *ln3_w, *ln3_b;
    float *self_k, *self_v;         /* [rows, heads, max_len, head_dim] of this layer */
    const float *cross_k, *cross_v; /* [rows, heads, src_len, head_dim] of this layer */
    int64_t kernel, hidden, heads, head_dim, ffn, max_len, src_len;
    float eps;
} WhisperLayer;

typedef struct {
    int64_t rows;       /* B: cache rows 0..B-1 decode one token each */
    const int64_t *pos; /* [B] the position each row writes (it sees keys 0..pos) */
    float *x;           /* [B, hidden] residual stream, in and out */
    float *h, *qkv, *attn, *ff, *scores; /* scratch [B, hidden], [B, 3 hidden], [B, hidden],
                                            [B, ffn], [B * heads, max(max_len, src_len)] */
} WhisperStep;

static void linear(const uint16_t *w, const float *b, const float *x, int64_t rows, int64_t in,
                   int64_t out, int kernel, float *y) {
    dense16_gemm(x, rows, in, w, kernel, out, y);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < out; i++) y[r * out + i] += b[i];
}

/* out = LayerNorm(x) * w + b per row, statistics in double (rows of a few hundred). */
static void layer_norm(const float *x, const float *w, const float *b, int64_t rows, int64_t dim,
                       float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        double mean = 0, var = 0;
        for (int64_t i = 0; i < dim; i++) mean += xr[i];
        mean /= dim;
        for (int64_t i = 0; i < dim; i++) var += (xr[i] - mean) * (xr[i] - mean);
        const float inv = (float)(1.0 / sqrt(var / dim + eps));
        for (int64_t i = 0; i < dim; i++)
            out[r * dim + i] = ((xr[i] - (float)mean) * inv) * w[i] + b[i];
    }
}

/* out[D] = softmax(q . K[0..n) * scale) V for one head; K, V [n, D] rows; s [n] scratch. */
static void attend(const float *q, const float *K, const float *V, int64_t n, int64_t D,
                   float scale, float *s, float *out) {
    float top = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        const float *k = K + t * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += q[d] * k[d];
        s[t] = dot * scale;
        top = s[t] > top ? s[t] : top;
    }
    float sum = 0.f;
    for (int64_t t = 0; t < n; t++) {
        s[t] = expf(s[t] - top);
        sum += s[t];
    }
    for (int64_t d = 0; d < D; d++) out[d] = 0.f;
    for (int64_t t = 0; t < n; t++) {
        const float p = s[t] / sum, *v = V + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) out[d] += p * v[d];
    }
}

void whisper_decode_layer(const WhisperLayer *L, const WhisperStep *s) {
    const int64_t B = s->rows, H = L->hidden, NH = L->heads, D = L->head_dim;
    const int64_t width = L->max_len > L->src_len ? L->max_len : L->src_len;
    const float scale = 1.f / sqrtf((float)D);
    const int kernel = (int)L->kernel;

    layer_norm(s->x, L->ln1_w, L->ln1_b, B, H, L->eps, s->h);
    linear(L->qkv, L->qkv_b, s->h, B, H, 3 * H, kernel, s->qkv); /* [B, q | k | v] */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < NH; h++) {
            const int64_t at = ((b * NH + h) * L->max_len + s->pos[b]) * D;
            memcpy(L->self_k + at, s->qkv + b * 3 * H + H + h * D, D * sizeof(float));
            memcpy(L->self_v + at, s->qkv + b * 3 * H + 2 * H + h * D, D * sizeof(float));
        }
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < B * NH; bh++) {
        const int64_t b = bh / NH, h = bh % NH, base = bh * L->max_len * D;
        attend(s->qkv + b * 3 * H + h * D, L->self_k + base, L->self_v + base, s->pos[b] + 1, D,
               scale, s->scores + bh * width, s->attn + b * H + h * D);
    }
    linear(L->o, L->o_b, s->attn, B, H, H, kernel, s->h);
    for (int64_t i = 0; i < B * H; i++) s->x[i] += s->h[i];

    layer_norm(s->x, L->ln2_w, L->ln2_b, B, H, L->eps, s->h);
    linear(L->cross_q, L->cross_q_b, s->h, B, H, H, kernel, s->qkv); /* [B, q] */
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < B * NH; bh++) {
        const int64_t b = bh / NH, h = bh % NH, base = bh * L->src_len * D;
        attend(s->qkv + b * H + h * D, L->cross_k + base, L->cross_v + base, L->src_len, D,
               scale, s->scores + bh * width, s->attn + b * H + h * D);
    }
    linear(L->cross_o, L->cross_o_b, s->attn, B, H, H, kernel, s->h);
    for (int64_t i = 0; i < B * H; i++) s->x[i] += s->h[i];

    layer_norm(s->x, L->ln3_w, L->ln3_b, B, H, L->eps, s->h);
    linear(L->fc1, L->fc1_b, s->h, B, H, L->ffn, kernel, s->ff);
#pragma omp parallel for schedule(static) if (B * L->ffn >= 16384)
    for (int64_t i = 0; i < B * L->ffn; i++)
        s->ff[i] = 0.5f * s->ff[i] * (1.f + erff(s->ff[i] * 0.70710678118654752f));
    linear(L->fc2, L->fc2_b, s->ff, B, L->ffn, H, kernel, s->h);
    for (int64_t i = 0; i < B * H; i++) s->x[i] += s->h[i];
}
