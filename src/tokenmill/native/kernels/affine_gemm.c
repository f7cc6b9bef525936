/* y[M, N] = x[M, K] . W^T for W in affine groups of 32: w = scale * q + offset, q unsigned
 * (4 or 8 bits). Activations are quantized per group of 32 in two int8 terms,
 * x ~= d (256 q1 + q2) with d = max|x| / (127 * 256) (q2 quantizes what q1 leaves), so
 * about 15 bits: finer than bfloat16, where one int8 term (llama.cpp's Q8) costs visible
 * quality on small models. The integer dot products run on AVX512-VNNI (vpdpbusd:
 * unsigned weights x signed activations); the offset term uses the exact float sum of
 * each activation group.
 *
 * Weight layout (built by tokenmill/native/__init__.py), per tile of 16 output rows and
 * group g of 32 inputs:
 *   4-bit: 4 steps of 8 inputs, 64 bytes each: byte 4r + j = q[r, k + j] | q[r, k + 4 + j] << 4
 *   8-bit: 8 steps of 4 inputs, 64 bytes each: byte 4r + j = q[r, k + j]
 *   then scales[16] and offsets[16] as float16 (64 bytes).
 * so one 64-byte load feeds vpdpbusd for 16 rows at once, each lane a row.
 *
 * Threads: OpenMP over tiles, the runtime PyTorch itself loaded (same libgomp), so
 * torch.set_num_threads applies and no second thread pool competes for the cores.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32
#define TILE 16

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MBLOCK 4
#define PREFETCH 2048

static inline __m512 load16(const void *x, int bf16, int64_t k) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + k);
}

/* One token's activations -> two int8 terms per group (q1, q2 at qx + 2 g * 32), the group
 * scale d of 256 q1 + q2 (dx) and the exact group sums (sx). */
static void quantize_row(const void *x, int bf16, int64_t K, int8_t *qx, float *dx, float *sx) {
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m512 v[2] = {load16(x, bf16, g * GROUP), load16(x, bf16, g * GROUP + 16)};
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        sx[g] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
        float d1 = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        dx[g] = d1 / 256.f;
        __m512 vinv = _mm512_set1_ps(inv), vinv256 = _mm512_set1_ps(inv * 256.f);
        __m512 vd1 = _mm512_set1_ps(d1);
        int8_t *q1 = qx + 2 * g * GROUP, *q2 = q1 + GROUP;
        for (int h = 0; h < 2; h++) {
            __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], vinv)); /* nearest even */
            __m512 r = _mm512_fnmadd_ps(vd1, _mm512_cvtepi32_ps(a), v[h]); /* what q1 leaves */
            __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(r, vinv256));
            b = _mm512_max_epi32(_mm512_min_epi32(b, lim), nlim);
            _mm_storeu_si128((__m128i *)(q1 + 16 * h), _mm512_cvtepi32_epi8(a));
            _mm_storeu_si128((__m128i *)(q2 + 16 * h), _mm512_cvtepi32_epi8(b));
        }
    }
}

/* mb tokens (mb <= MBLOCK) x one tile of 16 rows. Four accumulators per token (term 1/2 x
 * even/odd step) keep the vpdpbusd dependency chains short. Always inlined with constant
 * bits and mb (see tile_dispatch), so the loops over tokens unroll and the accumulators
 * stay in registers. */
static inline __attribute__((always_inline)) void tile_kernel(
    const uint8_t *w, const int bits, int64_t groups, const int mb, const int8_t *qx,
    const float *dx, const float *sx, int64_t K, float *out /* [mb][16] */) {
    const int steps = bits == 4 ? 4 : 8;
    const int64_t group_bytes = (int64_t)steps * 64 + 64;
    __m512 y[MBLOCK];
    for (int m = 0; m < MBLOCK; m++) y[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * group_bytes;
        __m512i a[MBLOCK][4];
        for (int m = 0; m < MBLOCK; m++)
            a[m][0] = a[m][1] = a[m][2] = a[m][3] = _mm512_setzero_si512();
        /* the hardware prefetchers stop at 4 KB pages: keep PREFETCH bytes in flight */
        for (int s = 0; s <= steps; s++) _mm_prefetch((const char *)gw + PREFETCH + s * 64, _MM_HINT_T0);
        if (bits == 4) {
            for (int s = 0; s < 4; s++) {
                __m512i v = _mm512_loadu_si512((const void *)(gw + s * 64));
                __m512i lo = _mm512_and_si512(v, low4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int m = 0; m < mb; m++) {
                    const int32_t *q1 = (const int32_t *)(qx + 2 * (m * K + g * GROUP) + s * 8);
                    const int32_t *q2 = q1 + GROUP / 4;
                    a[m][0] = _mm512_dpbusd_epi32(a[m][0], lo, _mm512_set1_epi32(q1[0]));
                    a[m][1] = _mm512_dpbusd_epi32(a[m][1], hi, _mm512_set1_epi32(q1[1]));
                    a[m][2] = _mm512_dpbusd_epi32(a[m][2], lo, _mm512_set1_epi32(q2[0]));
                    a[m][3] = _mm512_dpbusd_epi32(a[m][3], hi, _mm512_set1_epi32(q2[1]));
                }
            }
        } else {
            for (int s = 0; s < 8; s += 2) {
                __m512i v0 = _mm512_loadu_si512((const void *)(gw + s * 64));
                __m512i v1 = _mm512_loadu_si512((const void *)(gw + s * 64 + 64));
                for (int m = 0; m < mb; m++) {
                    const int32_t *q1 = (const int32_t *)(qx + 2 * (m * K + g * GROUP) + s * 4);
                    const int32_t *q2 = q1 + GROUP / 4;
                    a[m][0] = _mm512_dpbusd_epi32(a[m][0], v0, _mm512_set1_epi32(q1[0]));
                    a[m][1] = _mm512_dpbusd_epi32(a[m][1], v1, _mm512_set1_epi32(q1[1]));
                    a[m][2] = _mm512_dpbusd_epi32(a[m][2], v0, _mm512_set1_epi32(q2[0]));
                    a[m][3] = _mm512_dpbusd_epi32(a[m][3], v1, _mm512_set1_epi32(q2[1]));
                }
            }
        }
        const uint8_t *sc = gw + steps * 64;
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
        for (int m = 0; m < mb; m++) {
            int64_t gi = m * (K / GROUP) + g;
            /* 256 term1 + term2 < 2^31: |term1| <= 32 * 255 * 127 */
            __m512i t1 = _mm512_add_epi32(a[m][0], a[m][1]);
            __m512i t2 = _mm512_add_epi32(a[m][2], a[m][3]);
            __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(t1, 8), t2));
            y[m] = _mm512_fmadd_ps(f, _mm512_mul_ps(scale, _mm512_set1_ps(dx[gi])), y[m]);
            y[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sx[gi]), y[m]);
        }
    }
    for (int m = 0; m < mb; m++) _mm512_storeu_ps(out + m * TILE, y[m]);
}

#define TILE_CASE(B, MB)                                                                     \
    case (B) * 8 + (MB):                                                                     \
        tile_kernel(w, B, groups, MB, qx, dx, sx, K, out);                                   \
        break;

static void tile_dispatch(const uint8_t *w, int bits, int64_t groups, int mb, const int8_t *qx,
                          const float *dx, const float *sx, int64_t K, float *out) {
    switch (bits * 8 + mb) {
        TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
        TILE_CASE(8, 1) TILE_CASE(8, 2) TILE_CASE(8, 3) TILE_CASE(8, 4)
    }
}

/* x [M, K] (float32 or bfloat16), w tiles [N / 16][K / 32][...], y [M, N] (float32 or bfloat16).
 * work: 2 * M * K int8 + 2 * M * K / 32 floats of scratch. */
void affine_gemm(const void *x, _Bool x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits,
                 int64_t N, void *y, _Bool y_bf16, int8_t *qx, float *dx, float *sx) {
    const int64_t groups = K / GROUP, tiles = N / TILE;
    const int64_t tile_bytes = groups * ((bits == 4 ? 4 : 8) * 64 + 64);
    const int64_t xsize = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M * K > 8192)
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * xsize, x_bf16, K, qx + 2 * m * K, dx + m * groups,
                     sx + m * groups);
    const int64_t mblocks = (M + MBLOCK - 1) / MBLOCK;
    /* tile-major: a tile's weights come from memory once and serve every token from L1 */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t mbi = 0; mbi < mblocks; mbi++) {
            int64_t m0 = mbi * MBLOCK;
            int mb = (int)(M - m0 < MBLOCK ? M - m0 : MBLOCK);
            float out[MBLOCK * TILE];
            tile_dispatch(w + t * tile_bytes, bits, groups, mb, qx + 2 * m0 * K, dx + m0 * groups,
                          sx + m0 * groups, K, out);
            for (int m = 0; m < mb; m++) {
                if (y_bf16) {
                    uint16_t *dst = (uint16_t *)y + (m0 + m) * N + t * TILE;
                    for (int r = 0; r < TILE; r++) dst[r] = f32_to_bf16(out[m * TILE + r]);
                } else {
                    memcpy((float *)y + (m0 + m) * N + t * TILE, out + m * TILE, TILE * 4);
                }
            }
        }
    }
}

/* -- many rows: affine_gemm_rows ------------------------------------------------------
 * The batched path of an encoder (thousands of tokens per call): 8-bit weights only,
 * float32 in and out, bias added. ``terms`` = 1 quantizes each activation group of 32 to
 * one int8 term (d = max|x| / 127, half the dot products of two terms); 2 is the two-term
 * scheme above. A register block is RB tokens x NB tiles (32 output rows): each weight
 * load serves RB tokens and each broadcast activation NB tiles. Tokens go in chunks of
 * RCHUNK so a chunk's quantized activations stay in L2 while every tile passes over them. */
#define RB 4
#define NB 2
#define RCHUNK 256
#define GROUP8_BYTES (8 * 64 + 64)

/* 16 floats -> bfloat16, round to nearest even (f32_to_bf16 vectorized; NaN stays NaN) */
static inline __m256i to_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* exp(y) for y <= 0: 2^n e^r, |r| <= ln2 / 2, degree-6 Taylor (relative error ~1e-7) */
static inline __m512 exp_neg(__m512 y) {
    y = _mm512_max_ps(y, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), y);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* GELU with the exact erf: x/2 (1 + erf(x / sqrt 2)); erf by Abramowitz-Stegun 7.1.26
 * (absolute error <= 1.5e-7). 1 + erf(z) for z < 0 is the series term itself, so
 * negative inputs keep their relative precision (no 1 - (1 - e) cancellation). */
static inline __m512 gelu_erf(__m512 x) {
    __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.707106781f));
    __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f),
                             _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.f)));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    __m512 tail = _mm512_mul_ps(_mm512_mul_ps(p, t), exp_neg(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), z)));
    /* 1 + erf(x / sqrt 2): 2 - tail for x >= 0, tail for x < 0 */
    __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    __m512 one_plus = _mm512_mask_sub_ps(tail, pos, _mm512_set1_ps(2.f), tail);
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), one_plus);
}

static void quantize_row1(const void *x, int bf16, int64_t K, int8_t *qx, float *dx, float *sx) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m512 v0 = load16(x, bf16, g * GROUP), v1 = load16(x, bf16, g * GROUP + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        dx[g] = amax / 127.f;
        __m512 vinv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m512i a0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv));
        __m512i a1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
        /* the sum of the quantized group, not of x: the offset term then pairs with the
         * same activations as the codes (w = scale q + offset), and with unsigned codes
         * that halves the error (|scale q| is about |offset| larger than |w|) */
        sx[g] = dx[g] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
        _mm_storeu_si128((__m128i *)(qx + g * GROUP), _mm512_cvtepi32_epi8(a0));
        _mm_storeu_si128((__m128i *)(qx + g * GROUP + 16), _mm512_cvtepi32_epi8(a1));
    }
}

/* mb tokens x nt tiles; qx rows of terms * K bytes (a group's terms side by side). */
static inline __attribute__((always_inline)) void rows_kernel(
    const uint8_t *w, int64_t tile_bytes, const int nt, const int mb, const int terms,
    int64_t groups, const int8_t *qx, const float *dx, const float *sx, int64_t K,
    const float *bias, const void *res, const int gelu, void *y, const int y_bf16, int64_t N) {
    __m512 acc[RB][NB];
    for (int m = 0; m < RB; m++)
        for (int t = 0; t < NB; t++) acc[m][t] = _mm512_setzero_ps();
    const int64_t qrow = terms * K;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * GROUP8_BYTES;
        __m512i a[RB][NB][2];
        for (int m = 0; m < RB; m++)
            for (int t = 0; t < NB; t++) a[m][t][0] = a[m][t][1] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            __m512i v[NB];
            for (int t = 0; t < nt; t++)
                v[t] = _mm512_loadu_si512((const void *)(gw + t * tile_bytes + s * 64));
            for (int m = 0; m < mb; m++) {
                const int8_t *q = qx + m * qrow + g * GROUP * terms + 4 * s;
                for (int u = 0; u < terms; u++) {
                    __m512i b = _mm512_set1_epi32(*(const int32_t *)(q + u * GROUP));
                    for (int t = 0; t < nt; t++) a[m][t][u] = _mm512_dpbusd_epi32(a[m][t][u], v[t], b);
                }
            }
        }
        __m512 scale[NB], offset[NB];
        for (int t = 0; t < nt; t++) {
            const uint8_t *sc = gw + t * tile_bytes + 8 * 64;
            scale[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
            offset[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
        }
        for (int m = 0; m < mb; m++) {
            __m512 d = _mm512_set1_ps(dx[m * groups + g]), sm = _mm512_set1_ps(sx[m * groups + g]);
            for (int t = 0; t < nt; t++) {
                __m512i i = terms == 2 ? _mm512_add_epi32(_mm512_slli_epi32(a[m][t][0], 8), a[m][t][1])
                                       : a[m][t][0];
                acc[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(scale[t], d), acc[m][t]);
                acc[m][t] = _mm512_fmadd_ps(offset[t], sm, acc[m][t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        __m512 b = bias ? _mm512_loadu_ps(bias + t * TILE) : _mm512_setzero_ps();
        for (int m = 0; m < mb; m++) {
            __m512 v = _mm512_add_ps(acc[m][t], b);
            if (res) v = _mm512_add_ps(v, load16(res, y_bf16, m * N + t * TILE));
            if (gelu) v = gelu_erf(v);
            if (y_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + m * N + t * TILE), to_bf16x16(v));
            else
                _mm512_storeu_ps((float *)y + m * N + t * TILE, v);
        }
    }
}

#define ROWS_CASE(U, NT, MB)                                                                 \
    case (U) * 100 + (NT) * 10 + (MB):                                                       \
        rows_kernel(w, tile_bytes, NT, MB, U, groups, qx, dx, sx, K, bias, res, gelu, y,     \
                    y_bf16, N);                                                              \
        break;
#define ROWS_MB(U, NT) ROWS_CASE(U, NT, 1) ROWS_CASE(U, NT, 2) ROWS_CASE(U, NT, 3) ROWS_CASE(U, NT, 4)

static void rows_dispatch(const uint8_t *w, int64_t tile_bytes, int nt, int mb, int terms,
                          int64_t groups, const int8_t *qx, const float *dx, const float *sx,
                          int64_t K, const float *bias, const void *res, int gelu, void *y,
                          int y_bf16, int64_t N) {
    switch (terms * 100 + nt * 10 + mb) {
        ROWS_MB(1, 1) ROWS_MB(1, 2) ROWS_MB(2, 1) ROWS_MB(2, 2)
    }
}

/* x [M, K] and y [M, N] float32 or bfloat16 (both alike), w: 8-bit tiles [N / 16][...],
 * bias [N] float32 or NULL, res [M, N] (y's dtype) or NULL: added to y (a residual);
 * gelu: y = GELU(x W^T + bias) (exact erf form, after any residual).
 * work: terms * M * K int8 + 2 * M * K / 32 floats. One parallel region, and none below
 * SERIAL_MACS: on shared cores each region can wait a time slice for a descheduled thread,
 * far more than a small product costs on one core. */
#define SERIAL_MACS (1 << 24)

void affine_gemm_rows(const void *x, _Bool bf16, int64_t M, int64_t K, const uint8_t *w,
                      int64_t N, const float *bias, const void *res, int gelu, int terms,
                      void *y,
                      int8_t *qx, float *dx, float *sx) {
    const int64_t xsize = bf16 ? 2 : 4;
    const int64_t groups = K / GROUP, tiles = N / TILE, tile_bytes = groups * GROUP8_BYTES;
    const int64_t chunks = (M + RCHUNK - 1) / RCHUNK, pairs = (tiles + NB - 1) / NB;
    /* Rows per chunk: M spread evenly (a multiple of RB: whole register blocks). With 610
     * rows, chunks of 256, 256 and 98 gave one of two threads 1.7x the other's work under
     * the static split of the jobs (32 short sentences: 490 -> 725 sentences/s). */
    const int64_t per = ((M + chunks - 1) / chunks + RB - 1) / RB * RB;
#pragma omp parallel if (M * K * N >= SERIAL_MACS)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const char *row = (const char *)x + m * K * xsize;
            if (terms == 2)
                quantize_row(row, bf16, K, qx + 2 * m * K, dx + m * groups, sx + m * groups);
            else
                quantize_row1(row, bf16, K, qx + m * K, dx + m * groups, sx + m * groups);
        }
#pragma omp for schedule(static)
        for (int64_t job = 0; job < chunks * pairs; job++) {
            const int64_t c = job / pairs, t0 = (job % pairs) * NB;
            const int nt = (int)(tiles - t0 < NB ? tiles - t0 : NB);
            const int64_t end = (c + 1) * per < M ? (c + 1) * per : M;
            for (int64_t m0 = c * per; m0 < end; m0 += RB) {
                const int mb = (int)(end - m0 < RB ? end - m0 : RB);
                const int64_t at = (m0 * N + t0 * TILE) * xsize;
                rows_dispatch(w + t0 * tile_bytes, tile_bytes, nt, mb, terms, groups,
                              qx + terms * m0 * K, dx + m0 * groups, sx + m0 * groups, K,
                              bias ? bias + t0 * TILE : 0, res ? (const char *)res + at : 0,
                              gelu, (char *)y + at, bf16, N);
            }
        }
    }
}

#else
/* -- portable C: the same contract, for builds without AVX-512 VNNI ----------------- */
static inline float load1(const void *x, int bf16, int64_t k) {
    if (!bf16) return ((const float *)x)[k];
    uint32_t u = (uint32_t)((const uint16_t *)x)[k] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void store1(void *y, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* nearest even, as cvtps2dq under the default rounding mode */
static inline int32_t round_even(float f) { return (int32_t)nearbyintf(f); }

static void quantize_row(const void *x, int bf16, int64_t K, int8_t *qx, float *dx, float *sx) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        float v[GROUP], amax = 0.f, sum = 0.f;
        for (int i = 0; i < GROUP; i++) {
            v[i] = load1(x, bf16, g * GROUP + i);
            amax = fmaxf(amax, fabsf(v[i]));
            sum += v[i];
        }
        sx[g] = sum;
        float d1 = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        dx[g] = d1 / 256.f;
        int8_t *q1 = qx + 2 * g * GROUP, *q2 = q1 + GROUP;
        for (int i = 0; i < GROUP; i++) {
            int32_t a = round_even(v[i] * inv);
            int32_t b = round_even(fmaf(-d1, (float)a, v[i]) * (inv * 256.f));
            q1[i] = (int8_t)a;
            q2[i] = (int8_t)(b > 127 ? 127 : b < -127 ? -127 : b);
        }
    }
}

static void quantize_row1(const void *x, int bf16, int64_t K, int8_t *qx, float *dx, float *sx) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        float v[GROUP], amax = 0.f;
        for (int i = 0; i < GROUP; i++) {
            v[i] = load1(x, bf16, g * GROUP + i);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        dx[g] = amax / 127.f;
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t total = 0;
        for (int i = 0; i < GROUP; i++) {
            int32_t a = round_even(v[i] * inv);
            qx[g * GROUP + i] = (int8_t)a;
            total += a;
        }
        sx[g] = dx[g] * (float)total;
    }
}

/* code of row r, input i of a group's code bytes (layout at the top) */
static inline int code_at(const uint8_t *gw, int bits, int r, int i) {
    if (bits == 8) return gw[(i / 4) * 64 + 4 * r + i % 4];
    uint8_t b = gw[(i / 8) * 64 + 4 * r + i % 4];
    return i % 8 < 4 ? b & 15 : b >> 4;
}

/* y[r] (16 rows of one tile) for one token whose activations are `terms` int8 rows of 32
 * per group (qx + g * terms * 32), scales dx and sums sx per group */
static void tile_rows(const uint8_t *w, int bits, int64_t groups, int terms, const int8_t *qx,
                      const float *dx, const float *sx, float *y) {
    const int64_t group_bytes = (bits == 4 ? 4 : 8) * 64 + 64;
    for (int r = 0; r < TILE; r++) y[r] = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * group_bytes;
        const uint16_t *sc = (const uint16_t *)(gw + group_bytes - 64);
        const int8_t *q = qx + g * terms * GROUP;
        for (int r = 0; r < TILE; r++) {
            int32_t t[2] = {0, 0};
            for (int i = 0; i < GROUP; i++)
                for (int u = 0; u < terms; u++) t[u] += code_at(gw, bits, r, i) * q[u * GROUP + i];
            int32_t i32 = terms == 2 ? t[0] * 256 + t[1] : t[0];
            float scale = _cvtsh_ss(sc[r]), offset = _cvtsh_ss(sc[TILE + r]);
            y[r] = fmaf((float)i32, scale * dx[g], y[r]);
            y[r] = fmaf(offset, sx[g], y[r]);
        }
    }
}

void affine_gemm(const void *x, _Bool x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits,
                 int64_t N, void *y, _Bool y_bf16, int8_t *qx, float *dx, float *sx) {
    const int64_t groups = K / GROUP, tiles = N / TILE;
    const int64_t tile_bytes = groups * ((bits == 4 ? 4 : 8) * 64 + 64);
    const int64_t xsize = x_bf16 ? 2 : 4;
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * xsize, x_bf16, K, qx + 2 * m * K, dx + m * groups,
                     sx + m * groups);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t m = 0; m < M; m++) {
            float out[TILE];
            tile_rows(w + t * tile_bytes, bits, groups, 2, qx + 2 * m * K, dx + m * groups,
                      sx + m * groups, out);
            for (int r = 0; r < TILE; r++) store1(y, y_bf16, m * N + t * TILE + r, out[r]);
        }
}

static inline float gelu_erf1(float x) { return 0.5f * x * (1.f + erff(x * 0.707106781f)); }

void affine_gemm_rows(const void *x, _Bool bf16, int64_t M, int64_t K, const uint8_t *w,
                      int64_t N, const float *bias, const void *res, int gelu, int terms,
                      void *y, int8_t *qx, float *dx, float *sx) {
    const int64_t xsize = bf16 ? 2 : 4;
    const int64_t groups = K / GROUP, tiles = N / TILE, tile_bytes = groups * (8 * 64 + 64);
    for (int64_t m = 0; m < M; m++) {
        const char *row = (const char *)x + m * K * xsize;
        if (terms == 2)
            quantize_row(row, bf16, K, qx + 2 * m * K, dx + m * groups, sx + m * groups);
        else
            quantize_row1(row, bf16, K, qx + m * K, dx + m * groups, sx + m * groups);
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t m = 0; m < M; m++) {
            float out[TILE];
            tile_rows(w + t * tile_bytes, 8, groups, terms, qx + terms * m * K, dx + m * groups,
                      sx + m * groups, out);
            for (int r = 0; r < TILE; r++) {
                int64_t i = m * N + t * TILE + r;
                float v = out[r] + (bias ? bias[t * TILE + r] : 0.f);
                if (res) v += load1(res, bf16, i);
                if (gelu) v = gelu_erf1(v);
                store1(y, bf16, i, v);
            }
        }
}
#endif
