/* One pre-norm decoder layer (Llama / Mistral / Qwen2 style) for a decode step, all native:
 * input norm (joining the residual stream), qkv projection, rotary + K/V store, paged
 * attention, o projection, post-attention norm, gated MLP. One call per layer instead of
 * ~40 Python-level operations; the float32 math is the same as the per-step kernels'.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

void affine_gemm(const void *x, _Bool x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits,
                 int terms, int64_t N, void *y, _Bool y_bf16, int8_t *qx, float *dx, float *sx);
void dense16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, int kernel, int64_t N,
                  float *y);
void silu_and_mul(const float *x, int64_t rows, int64_t inter, float *out);
void add_rms_norm(float *x, float *residual, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps_sum, _Bool add);
void rope_store_kv(float *qkv, int64_t tokens, int64_t row_stride, int64_t q_heads,
                   int64_t kv_heads, int64_t d, const float *cos, const float *sin, float *cache,
                   int64_t cache_slots, const int64_t *slots);
void decode_attention(const float *q, int64_t batch, int64_t q_stride, int64_t q_heads,
                      int64_t kv_heads, int64_t d, const float *cache, int64_t cache_slots,
                      int64_t block_size, const int64_t *block_tables, int64_t table_width,
                      const int64_t *seq_lens, float scale, int64_t window, float *out,
                      float *scratch, int64_t max_len, const int64_t *extra_slots,
                      int64_t max_extra);

typedef struct {
    const uint8_t *tiles;
    const float *bias; /* NULL: none */
    int64_t bits, out, in; /* bits 4, 8: affine groups; DENSE16 + k: 16-bit tiles, kernel k */
    int64_t terms;         /* affine groups: int8 activation terms (1 or 2) */
} Proj;

typedef struct {
    Proj qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* (w or 1 + w) * sqrt(hidden), float32 */
    float eps_sum, scale; /* eps_sum: hidden * the norms' eps */
    int64_t hidden, q_heads, kv_heads, head_dim, intermediate, window, activation; /* 0 silu, 1 gelu tanh */
    float *kv_cache;
    int64_t cache_slots, block_size;
} LayerDesc;

typedef struct {
    int64_t tokens, table_width, max_len, first_layer;
    float *hidden, *residual; /* [B, hidden]: in = previous layer's output, out = this one's */
    const float *cos, *sin;   /* [B, head_dim] */
    const int64_t *slots, *block_tables, *seq_lens;
    float *normed, *qkv, *attn, *gate_up, *act, *scores; /* scratch */
    int8_t *qx;
    float *dx, *sx;
    const int64_t *extra_slots; /* [B, max_extra] or NULL: draft-tree keys past each context */
    int64_t max_extra;
} StepArgs;

#define DENSE16 16

static void project(const Proj *p, const float *x, float *y, const StepArgs *s) {
    if (p->bits >= DENSE16)
        dense16_gemm(x, s->tokens, p->in, (const uint16_t *)p->tiles, (int)(p->bits - DENSE16),
                     p->out, y);
    else
        affine_gemm(x, 0, s->tokens, p->in, p->tiles, (int)p->bits, (int)p->terms, p->out, y, 0,
                    s->qx, s->dx, s->sx);
    if (p->bias)
        for (int64_t t = 0; t < s->tokens; t++)
            for (int64_t i = 0; i < p->out; i++) y[t * p->out + i] += p->bias[i];
}

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

void decode_layer(const LayerDesc *L, const StepArgs *s) {
    const int64_t B = s->tokens, H = L->hidden, I = L->intermediate, D = L->head_dim;
    if (s->first_layer) { /* the residual stream starts as the embeddings */
        memcpy(s->residual, s->hidden, B * H * sizeof(float));
        add_rms_norm(0, s->residual, L->input_norm, s->normed, B, H, L->eps_sum, 0);
    } else {
        add_rms_norm(s->hidden, s->residual, L->input_norm, s->normed, B, H, L->eps_sum, 1);
    }
    project(&L->qkv, s->normed, s->qkv, s);
    rope_store_kv(s->qkv, B, L->qkv.out, L->q_heads, L->kv_heads, D, s->cos, s->sin, L->kv_cache,
                  L->cache_slots, s->slots);
    decode_attention(s->qkv, B, L->qkv.out, L->q_heads, L->kv_heads, D, L->kv_cache,
                     L->cache_slots, L->block_size, s->block_tables, s->table_width, s->seq_lens,
                     L->scale, L->window, s->attn, s->scores, s->max_len, s->extra_slots,
                     s->max_extra);
    project(&L->o, s->attn, s->hidden, s);
    add_rms_norm(s->hidden, s->residual, L->post_norm, s->normed, B, H, L->eps_sum, 1);
    project(&L->gate_up, s->normed, s->gate_up, s);
    if (L->activation == 0) {
        silu_and_mul(s->gate_up, B, I, s->act); /* the prefill's kernel: the same bits */
    } else {
#pragma omp parallel for schedule(static) if (B > 1) /* a verify step's rows */
        for (int64_t t = 0; t < B; t++) {
            const float *g = s->gate_up + t * 2 * I, *u = g + I;
            float *a = s->act + t * I;
            for (int64_t i = 0; i < I; i++) a[i] = gelu_tanh(g[i]) * u[i];
        }
    }
    project(&L->down, s->act, s->hidden, s);
}

/* Layers descs[0 .. n) in order, one call for a whole step (no Python between layers):
 * the first starts the residual stream when s->first_layer says so. */
void decode_layers(const LayerDesc *descs, int64_t n, StepArgs *s) {
    for (int64_t i = 0; i < n; i++) {
        decode_layer(descs + i, s);
        s->first_layer = 0;
    }
}
