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
#define MBLOCK 4  /* tokens per register block: two activation terms */
#define MBLOCK1 8 /* one term */
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

/* mb tokens x one tile of 16 rows, the activations in ``terms`` int8 terms (qx rows of
 * terms * K bytes, a group's terms side by side). Two terms: four accumulators per token
 * (term 1/2 x even/odd step), mb <= MBLOCK; one term: two (even/odd step), mb <= MBLOCK1,
 * so twice the tokens share each weight load. Short vpdpbusd dependency chains either
 * way. Always inlined with constant bits, terms and mb (see tile_dispatch), so the loops
 * over tokens unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_kernel(
    const uint8_t *w, const int bits, const int terms, int64_t groups, const int mb,
    const int8_t *qx, const float *dx, const float *sx, int64_t K, int once,
    float *out /* [mb][16] */) {
    const int steps = bits == 4 ? 4 : 8;
    const int64_t group_bytes = (int64_t)steps * 64 + 64, qrow = terms * K;
    __m512 y[MBLOCK1];
    for (int m = 0; m < mb; m++) y[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * group_bytes;
        __m512i a[MBLOCK1][4];
        for (int m = 0; m < mb; m++)
            for (int u = 0; u < 2 * terms; u++) a[m][u] = _mm512_setzero_si512();
        /* the hardware prefetchers stop at 4 KB pages: keep PREFETCH bytes in flight; where
         * one block takes every token (decode) non-temporally, so the weights streaming
         * through once do not push what the step reuses out of the caches (dense16_gemm.c:
         * NTA_PREFETCH; 7% shorter SmolLM2 Q4_1 decode steps) */
        if (once)
            for (int s = 0; s <= steps; s++) _mm_prefetch((const char *)gw + PREFETCH + s * 64, _MM_HINT_NTA);
        else
            for (int s = 0; s <= steps; s++) _mm_prefetch((const char *)gw + PREFETCH + s * 64, _MM_HINT_T0);
        for (int p = 0; p < 4; p++) {
            /* inputs 8 p .. 8 p + 7 as two 64-byte operands (4 inputs x 16 rows each): 4-bit,
             * the low and high nibbles of step p; 8-bit, steps 2 p and 2 p + 1 */
            __m512i v0, v1;
            if (bits == 4) {
                __m512i v = _mm512_loadu_si512((const void *)(gw + p * 64));
                v0 = _mm512_and_si512(v, low4);
                v1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            } else {
                v0 = _mm512_loadu_si512((const void *)(gw + p * 128));
                v1 = _mm512_loadu_si512((const void *)(gw + p * 128 + 64));
            }
            for (int m = 0; m < mb; m++)
                for (int u = 0; u < terms; u++) {
                    const int32_t *q = (const int32_t *)(qx + m * qrow + (g * terms + u) * GROUP + p * 8);
                    a[m][2 * u] = _mm512_dpbusd_epi32(a[m][2 * u], v0, _mm512_set1_epi32(q[0]));
                    a[m][2 * u + 1] = _mm512_dpbusd_epi32(a[m][2 * u + 1], v1, _mm512_set1_epi32(q[1]));
                }
        }
        const uint8_t *sc = gw + steps * 64;
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
        for (int m = 0; m < mb; m++) {
            int64_t gi = m * (K / GROUP) + g;
            /* 256 term1 + term2 < 2^31: |term1| <= 32 * 255 * 127 */
            __m512i i = _mm512_add_epi32(a[m][0], a[m][1]);
            if (terms == 2) i = _mm512_add_epi32(_mm512_slli_epi32(i, 8), _mm512_add_epi32(a[m][2], a[m][3]));
            __m512 f = _mm512_cvtepi32_ps(i);
            y[m] = _mm512_fmadd_ps(f, _mm512_mul_ps(scale, _mm512_set1_ps(dx[gi])), y[m]);
            y[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sx[gi]), y[m]);
        }
    }
    for (int m = 0; m < mb; m++) _mm512_storeu_ps(out + m * TILE, y[m]);
}

#define TILE_CASE(B, U, MB)                                                                  \
    case (B) * 1000 + (U) * 100 + (MB):                                                      \
        tile_kernel(w, B, U, groups, MB, qx, dx, sx, K, once, out);                          \
        break;
#define TILE_MB4(B, U) TILE_CASE(B, U, 1) TILE_CASE(B, U, 2) TILE_CASE(B, U, 3) TILE_CASE(B, U, 4)
#define TILE_MB8(B) TILE_MB4(B, 1) TILE_CASE(B, 1, 5) TILE_CASE(B, 1, 6) TILE_CASE(B, 1, 7) TILE_CASE(B, 1, 8)

static inline int tile_mblock(int terms) { return terms == 1 ? MBLOCK1 : MBLOCK; }

static void tile_dispatch(const uint8_t *w, int bits, int terms, int64_t groups, int mb,
                          const int8_t *qx, const float *dx, const float *sx, int64_t K,
                          int once, float *out) {
    switch (bits * 1000 + terms * 100 + mb) {
        TILE_MB4(4, 2) TILE_MB4(8, 2) TILE_MB8(4) TILE_MB8(8)
    }
}

/* out [mb][16] -> rows m0 .. m0 + mb - 1, columns of tile t, of y (float32 or bfloat16) */
static void store_tile(const float *out, int mb, void *y, int y_bf16, int64_t m0, int64_t N,
                       int64_t t) {
    for (int m = 0; m < mb; m++) {
        if (y_bf16) {
            uint16_t *dst = (uint16_t *)y + (m0 + m) * N + t * TILE;
            for (int r = 0; r < TILE; r++) dst[r] = f32_to_bf16(out[m * TILE + r]);
        } else {
            memcpy((float *)y + (m0 + m) * N + t * TILE, out + m * TILE, TILE * 4);
        }
    }
}

/* -- AMX-INT8 for blocks of 16 tokens ---------------------------------------------------
 * Where Linux grants the tile state (dense16_amx_enable), each full block of 16 tokens
 * takes its integer dot products from tdpbsud (signed activations x unsigned codes): per
 * group and tile, C1 = q1 . codes and C2 = q2 . codes (16 tokens x 16 rows, int32). Integer
 * sums are exact in any order, so these are tile_kernel's t1 and t2 to the bit, and the
 * float steps after them are tile_kernel's, in its order: the same bits as the VNNI path
 * for every token, whatever its block. Tokens past the last full block take the VNNI path.
 * A group's codes are an AMX B tile as packed (8 rows of 4 inputs x 16 rows); 4-bit codes
 * are split into their two nibble rows first. Tiles: 0-1 C1/C2, 2-3 q1/q2, 4 the codes. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define AFFINE_AMX 1
int dense16_amx_enable(void);
static int amx_min_rows = 16; /* affine_set_amx(0): never (tests compare the two paths) */

void affine_set_amx(int on) { amx_min_rows = on ? 16 : 1 << 30; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AffineAmxConfig;

static void affine_amx_configure(void) {
    AffineAmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = 16, c.colsb[0] = c.colsb[1] = 64; /* C: 16 tokens x 16 int32 */
    c.rows[2] = c.rows[3] = 16, c.colsb[2] = c.colsb[3] = 32; /* A: 16 tokens x 32 int8 */
    c.rows[4] = 8, c.colsb[4] = 64;                           /* B: 8 quads x 16 rows */
    _tile_loadconfig(&c);
}

/* One tile of 16 rows x 16 tokens (m0 .. m0 + 15) -> out [16 tokens][16]; one or two
 * activation terms (qx rows of terms * K bytes; one term: C1 only) */
static void amx_tile_block(const uint8_t *w, int bits, int terms, int64_t groups,
                           const int8_t *qx, const float *dx, const float *sx, int64_t K,
                           float *out) {
    const int steps = bits == 4 ? 4 : 8;
    const int64_t group_bytes = (int64_t)steps * 64 + 64;
    uint8_t codes[8 * 64] __attribute__((aligned(64)));
    int32_t c1[16 * 16] __attribute__((aligned(64))), c2[16 * 16] __attribute__((aligned(64)));
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 y[16];
    for (int m = 0; m < 16; m++) y[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * group_bytes;
        _mm_prefetch((const char *)gw + PREFETCH, _MM_HINT_T0);
        const uint8_t *b = gw;
        if (bits == 4) {
            for (int s = 0; s < 4; s++) {
                __m512i v = _mm512_loadu_si512((const void *)(gw + s * 64));
                _mm512_store_si512((void *)(codes + 128 * s), _mm512_and_si512(v, low4));
                _mm512_store_si512((void *)(codes + 128 * s + 64),
                                   _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
            }
            b = codes;
        }
        _tile_zero(0);
        _tile_loadd(4, b, 64);
        _tile_loadd(2, qx + terms * g * GROUP, terms * K);
        _tile_dpbsud(0, 2, 4);
        _tile_stored(0, c1, 64);
        if (terms == 2) {
            _tile_zero(1);
            _tile_loadd(3, qx + 2 * g * GROUP + GROUP, 2 * K);
            _tile_dpbsud(1, 3, 4);
            _tile_stored(1, c2, 64);
        }
        const uint8_t *sc = gw + steps * 64;
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
        for (int m = 0; m < 16; m++) {
            int64_t gi = m * (K / GROUP) + g;
            __m512i i = _mm512_load_si512((const void *)(c1 + 16 * m));
            if (terms == 2)
                i = _mm512_add_epi32(_mm512_slli_epi32(i, 8), _mm512_load_si512((const void *)(c2 + 16 * m)));
            __m512 f = _mm512_cvtepi32_ps(i);
            y[m] = _mm512_fmadd_ps(f, _mm512_mul_ps(scale, _mm512_set1_ps(dx[gi])), y[m]);
            y[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sx[gi]), y[m]);
        }
    }
    for (int m = 0; m < 16; m++) _mm512_storeu_ps(out + m * TILE, y[m]);
}
#else
void affine_set_amx(int on) { (void)on; }
#endif

static void quantize_row1(const void *x, int bf16, int64_t K, int8_t *qx, float *dx, float *sx);

/* x [M, K] (float32 or bfloat16), w tiles [N / 16][K / 32][...], y [M, N] (float32 or bfloat16).
 * terms: 2 (the scheme above) or 1 (one int8 term per activation, d = max|x| / 127 and sx
 * the quantized group's sum, as affine_gemm_rows: half the dot products, ~8 bits).
 * work: terms * M * K int8 + 2 * M * K / 32 floats of scratch. */
void affine_gemm(const void *x, _Bool x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits,
                 int terms, int64_t N, void *y, _Bool y_bf16, int8_t *qx, float *dx, float *sx) {
    const int64_t groups = K / GROUP, tiles = N / TILE;
    const int64_t tile_bytes = groups * ((bits == 4 ? 4 : 8) * 64 + 64);
    const int64_t xsize = x_bf16 ? 2 : 4, qrow = terms * K;
    const int mbk = tile_mblock(terms);
#pragma omp parallel for schedule(static) if (M * K > 8192)
    for (int64_t m = 0; m < M; m++)
        (terms == 1 ? quantize_row1 : quantize_row)((const char *)x + m * K * xsize, x_bf16, K,
                                                    qx + m * qrow, dx + m * groups, sx + m * groups);
    int64_t amx_rows = 0; /* tokens 0 .. amx_rows - 1 go through AMX, 16 at a time */
#ifdef AFFINE_AMX
    if (M >= amx_min_rows && dense16_amx_enable()) amx_rows = M / 16 * 16;
#endif
    const int64_t mblocks = (M - amx_rows + mbk - 1) / mbk;
    const int once = mblocks == 1 && amx_rows == 0; /* each weight read by one block only */
    /* tile-major: a tile's weights come from memory once and serve every token from L1 */
#pragma omp parallel
    {
#ifdef AFFINE_AMX
    if (amx_rows) affine_amx_configure();
#endif
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
#ifdef AFFINE_AMX
        for (int64_t m0 = 0; m0 < amx_rows; m0 += 16) {
            float out[16 * TILE];
            amx_tile_block(w + t * tile_bytes, bits, terms, groups, qx + m0 * qrow,
                           dx + m0 * groups, sx + m0 * groups, K, out);
            store_tile(out, 16, y, y_bf16, m0, N, t);
        }
#endif
        for (int64_t mbi = 0; mbi < mblocks; mbi++) {
            int64_t m0 = amx_rows + mbi * mbk;
            int mb = (int)(M - m0 < mbk ? M - m0 : mbk);
            float out[MBLOCK1 * TILE];
            tile_dispatch(w + t * tile_bytes, bits, terms, groups, mb, qx + m0 * qrow,
                          dx + m0 * groups, sx + m0 * groups, K, once, out);
            store_tile(out, mb, y, y_bf16, m0, N, t);
        }
    }
#ifdef AFFINE_AMX
    if (amx_rows) _tile_release();
#endif
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

/* silu(g) = g sigmoid(g), sigmoid from e = exp(-|g|): 1 / (1 + e), or e / (1 + e) for g < 0
 * (no overflow either way) */
static inline __m512 silu16(__m512 g) {
    __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 r = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
    __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(g, _mm512_mask_mul_ps(r, neg, r, e));
}

/* out [rows, I] = silu(gate) * up for x [rows, 2 I] = [gate | up], float32 */
void silu_and_mul(const float *x, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 16) {
            __mmask16 m = inter - i >= 16 ? 0xffff : (__mmask16)((1u << (inter - i)) - 1);
            __m512 v = silu16(_mm512_maskz_loadu_ps(m, g + i));
            _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, u + i)));
        }
    }
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

#else /* AVX2 + FMA + F16C (-mno-avx512f): the same functions, bit for bit */
void affine_set_amx(int on) { (void)on; } /* no AMX at this level */

/* No vpdpbusd: vpmaddubsw multiplies unsigned x signed bytes and adds pairs into int16
 * (saturating), vpmaddwd by 1 widens pairs of those to int32. The codes are used as 4-bit
 * nibbles (8-bit codes split into theirs), so a pair is at most 2 * 15 * 127 = 3810 and
 * an int16 lane can sum the 8 pairs of a whole group (<= 30480 < 32767) before one
 * vpmaddwd per group: 4-bit codes take 4 steps x (low, high) nibble, 8-bit ones 8 steps
 * per nibble, 16 x 3810 = 60960 for the two nibble sums kept apart and joined as
 * 16 high + low in int32. The integer dot products are thus those of vpdpbusd exactly,
 * and every float step is the AVX-512 one lane by lane in the same order (the horizontal
 * sums in the order of GCC's _mm512_reduce_add_ps), so both levels give the same bits.
 *
 * A unit is 8 output rows: half a tile, bytes 32 h .. 32 h + 31 of each 64-byte step,
 * one ymm register. 16 ymm registers hold MAX_MB tokens x (one int16 sum per term and
 * nibble + one float32 sum): mblock() picks how many tokens share each weight load. */
#define MAX_MB 4
#define PREFETCH 2048
#define RCHUNK 256
#define SERIAL_MACS (1 << 24)

/* tokens per register block: the int16 sums plus y of each token in 12 registers */
static inline int mblock(int bits, int terms) { return bits == 8 && terms == 2 ? 2 : 4; }

static inline __m256 load8(const void *x, int bf16, int64_t k) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + k);
}

static inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

static inline float hmax8(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return fmaxf(_mm_cvtss_f32(a), _mm_cvtss_f32(_mm_shuffle_ps(a, a, 1)));
}

/* the sum of 16 lanes (lo = 0-7, hi = 8-15) in _mm512_reduce_add_ps's order (GCC):
 * halves, then quarters, then (0 + 2) + (1 + 3) */
static inline float hsum16(__m256 lo, __m256 hi) {
    __m256 t = _mm256_add_ps(hi, lo);
    __m128 a = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(a) + _mm_cvtss_f32(_mm_shuffle_ps(a, a, 1));
}

/* 4 x 8 int32 (each in -127 .. 127) -> 32 int8 in order */
static inline void store_i8x32(int8_t *q, const __m256i *a) {
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
    /* packs works per 128-bit lane: dword i of p holds a[i % 4] lanes 4 (i / 4) .. + 3 */
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
}

static inline void load_group(const void *x, int bf16, int64_t k, __m256 *v) {
    for (int i = 0; i < 4; i++) v[i] = load8(x, bf16, k + 8 * i);
}

/* x = v[0..3] as 2 x 16 lanes (v[0] v[1]: the AVX-512 kernel's first zmm) */
static inline float group_amax(const __m256 *v) {
    return hmax8(_mm256_max_ps(_mm256_max_ps(abs8(v[0]), abs8(v[2])),
                               _mm256_max_ps(abs8(v[1]), abs8(v[3]))));
}

/* as the AVX-512 quantize_row: two int8 terms, scale dx, exact group sums sx */
static void quantize_row(const void *x, int bf16, int64_t K, int8_t *qx, float *dx, float *sx) {
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 v[4];
        load_group(x, bf16, g * GROUP, v);
        float amax = group_amax(v);
        sx[g] = hsum16(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
        float d1 = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        dx[g] = d1 / 256.f;
        const __m256 vinv = _mm256_set1_ps(inv), vinv256 = _mm256_set1_ps(inv * 256.f);
        const __m256 vd1 = _mm256_set1_ps(d1);
        __m256i a[4], b[4];
        for (int i = 0; i < 4; i++) {
            a[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv)); /* nearest even */
            __m256 r = _mm256_fnmadd_ps(vd1, _mm256_cvtepi32_ps(a[i]), v[i]); /* what q1 leaves */
            b[i] = _mm256_cvtps_epi32(_mm256_mul_ps(r, vinv256));
            b[i] = _mm256_max_epi32(_mm256_min_epi32(b[i], lim), nlim);
        }
        store_i8x32(qx + 2 * g * GROUP, a);
        store_i8x32(qx + 2 * g * GROUP + GROUP, b);
    }
}

/* as the AVX-512 quantize_row1: one int8 term, sx the sum of the quantized group */
static void quantize_row1(const void *x, int bf16, int64_t K, int8_t *qx, float *dx, float *sx) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 v[4];
        load_group(x, bf16, g * GROUP, v);
        float amax = group_amax(v);
        dx[g] = amax / 127.f;
        const __m256 vinv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i a[4];
        for (int i = 0; i < 4; i++) a[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
        __m256i t = _mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3]));
        __m128i s = _mm_add_epi32(_mm256_extracti128_si256(t, 1), _mm256_castsi256_si128(t));
        s = _mm_hadd_epi32(s, s);
        sx[g] = dx[g] * (float)(_mm_cvtsi128_si32(s) + _mm_extract_epi32(s, 1));
        store_i8x32(qx + g * GROUP, a);
    }
}

/* y[m] (8 rows: unit h of the tile at w) for mb tokens, qx rows of qrow bytes (a group's
 * terms side by side, 32 bytes each). Always inlined with constant bits, terms and mb
 * (unit_dispatch), so the token loops unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void unit_kernel(
    const uint8_t *w, int h, const int bits, const int terms, const int mb, int64_t groups,
    const int8_t *qx, int64_t qrow, const float *dx, const float *sx, __m256 *y) {
    const int steps = bits == 4 ? 4 : 8;
    const int64_t group_bytes = (int64_t)steps * 64 + 64;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int m = 0; m < mb; m++) y[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * group_bytes;
        /* the hardware prefetchers stop at 4 KB pages: keep PREFETCH bytes in flight (at one
         * token they alone measured as fast, within 1%) */
        if (h == 0 && mb > 1)
            for (int s = 0; s <= steps; s++) _mm_prefetch((const char *)gw + PREFETCH + s * 64, _MM_HINT_T0);
        __m256i a[MAX_MB][2][2]; /* int16 sums [token][term][low / high nibble of 8-bit codes] */
        for (int m = 0; m < mb; m++)
            for (int u = 0; u < terms; u++) a[m][u][0] = a[m][u][1] = _mm256_setzero_si256();
        for (int s = 0; s < steps; s++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(gw + s * 64 + 32 * h));
            __m256i lo = _mm256_and_si256(v, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int m = 0; m < mb; m++)
                for (int u = 0; u < terms; u++) {
                    const int8_t *q = qx + m * qrow + g * GROUP * terms + u * GROUP;
                    if (bits == 4) { /* inputs 8 s + j: low nibbles j < 4, high ones j >= 4 */
                        const int32_t *q4 = (const int32_t *)(q + 8 * s);
                        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(q4[0])),
                                                     _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q4[1])));
                        a[m][u][0] = _mm256_add_epi16(a[m][u][0], p);
                    } else { /* inputs 4 s + j, code = 16 high + low */
                        __m256i b = _mm256_set1_epi32(*(const int32_t *)(q + 4 * s));
                        a[m][u][0] = _mm256_add_epi16(a[m][u][0], _mm256_maddubs_epi16(lo, b));
                        a[m][u][1] = _mm256_add_epi16(a[m][u][1], _mm256_maddubs_epi16(hi, b));
                    }
                }
        }
        const uint8_t *sc = gw + steps * 64 + 16 * h;
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
        const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32)));
        for (int m = 0; m < mb; m++) {
            __m256i t[2];
            for (int u = 0; u < terms; u++) {
                t[u] = _mm256_madd_epi16(a[m][u][0], ones);
                if (bits == 8)
                    t[u] = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(a[m][u][1], ones), 4), t[u]);
            }
            /* 256 term1 + term2 < 2^31: |term1| <= 32 * 255 * 127 */
            __m256i i = terms == 2 ? _mm256_add_epi32(_mm256_slli_epi32(t[0], 8), t[1]) : t[0];
            const int64_t gi = m * groups + g;
            y[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(scale, _mm256_set1_ps(dx[gi])), y[m]);
            y[m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(sx[gi]), y[m]);
        }
    }
}

#define UNIT_CASE(B, U, MB)                                                                  \
    case (B) * 100 + (U) * 10 + (MB):                                                        \
        unit_kernel(w, h, B, U, MB, groups, qx, qrow, dx, sx, y);                            \
        break;
#define UNIT_MB4(B, U) UNIT_CASE(B, U, 1) UNIT_CASE(B, U, 2) UNIT_CASE(B, U, 3) UNIT_CASE(B, U, 4)

/* the (bits, terms, mb) the callers use: mb up to mblock(bits, terms) */
static void unit_dispatch(const uint8_t *w, int h, int bits, int terms, int mb, int64_t groups,
                          const int8_t *qx, int64_t qrow, const float *dx, const float *sx,
                          __m256 *y) {
    switch (bits * 100 + terms * 10 + mb) {
        UNIT_MB4(4, 1) UNIT_MB4(4, 2) UNIT_MB4(8, 1) UNIT_CASE(8, 2, 1) UNIT_CASE(8, 2, 2)
    }
}

/* 8 floats -> bfloat16, round to nearest even (f32_to_bf16 vectorized; NaN stays NaN) */
static inline __m128i to_bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void store8(void *y, int bf16, int64_t i, __m256 v) {
    if (bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)y + i), to_bf16x8(v));
    else
        _mm256_storeu_ps((float *)y + i, v);
}

/* x [M, K] (float32 or bfloat16), w tiles [N / 16][K / 32][...], y [M, N] (float32 or bfloat16),
 * terms 1 or 2 (see the AVX-512 version). work: terms * M * K int8 + 2 * M * K / 32 floats. */
void affine_gemm(const void *x, _Bool x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits,
                 int terms, int64_t N, void *y, _Bool y_bf16, int8_t *qx, float *dx, float *sx) {
    const int64_t groups = K / GROUP, tiles = N / TILE;
    const int64_t tile_bytes = groups * ((bits == 4 ? 4 : 8) * 64 + 64);
    const int64_t xsize = x_bf16 ? 2 : 4, qrow = terms * K;
    const int mbk = mblock(bits, terms);
#pragma omp parallel for schedule(static) if (M * K > 8192)
    for (int64_t m = 0; m < M; m++)
        (terms == 1 ? quantize_row1 : quantize_row)((const char *)x + m * K * xsize, x_bf16, K,
                                                    qx + m * qrow, dx + m * groups, sx + m * groups);
    /* tile-major: a tile's weights come from memory once and serve every token from L1 */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int h = 0; h < 2; h++)
            for (int64_t m0 = 0; m0 < M; m0 += mbk) {
                const int mb = (int)(M - m0 < mbk ? M - m0 : mbk);
                __m256 out[MAX_MB];
                unit_dispatch(w + t * tile_bytes, h, bits, terms, mb, groups, qx + m0 * qrow, qrow,
                              dx + m0 * groups, sx + m0 * groups, out);
                for (int m = 0; m < mb; m++) store8(y, y_bf16, (m0 + m) * N + t * TILE + 8 * h, out[m]);
            }
}

/* -- many rows: affine_gemm_rows (8-bit codes; see the AVX-512 version for the contract) */

/* exp(y) for y <= 0, as the AVX-512 exp_neg; 2^n built in the exponent field (n >= -126,
 * so p 2^n is one correctly rounded product, as vscalefps) */
static inline __m256 exp_neg(__m256 y) {
    y = _mm256_max_ps(y, _mm256_set1_ps(-87.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), y);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* silu as the AVX-512 silu16, lane by lane */
static inline __m256 silu8(__m256 g) {
    __m256 e = exp_neg(_mm256_sub_ps(_mm256_setzero_ps(), abs8(g)));
    __m256 r = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
    __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_mul_ps(g, _mm256_blendv_ps(r, _mm256_mul_ps(r, e), neg));
}

void silu_and_mul(const float *x, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        if (i < inter) { /* the tail through a zero-padded buffer */
            float gb[8] = {0}, ub[8] = {0}, ob[8];
            memcpy(gb, g + i, (inter - i) * 4);
            memcpy(ub, u + i, (inter - i) * 4);
            _mm256_storeu_ps(ob, _mm256_mul_ps(silu8(_mm256_loadu_ps(gb)), _mm256_loadu_ps(ub)));
            memcpy(o + i, ob, (inter - i) * 4);
        }
    }
}

/* GELU, exact erf form, as the AVX-512 gelu_erf */
static inline __m256 gelu_erf(__m256 x) {
    __m256 z = _mm256_mul_ps(abs8(x), _mm256_set1_ps(0.707106781f));
    __m256 t = _mm256_div_ps(_mm256_set1_ps(1.f),
                             _mm256_fmadd_ps(z, _mm256_set1_ps(0.3275911f), _mm256_set1_ps(1.f)));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    __m256 tail = _mm256_mul_ps(_mm256_mul_ps(p, t), exp_neg(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), z), z)));
    __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    __m256 one_plus = _mm256_blendv_ps(tail, _mm256_sub_ps(_mm256_set1_ps(2.f), tail), pos);
    return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), one_plus);
}

/* acc[m] + bias (+ res) (GELU) -> y, for mb tokens of one unit; at: y's element of (0, col) */
static inline void rows_store(const __m256 *acc, int mb, const float *bias, const void *res,
                              int gelu, void *y, int bf16, int64_t N, int64_t at) {
    const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    for (int m = 0; m < mb; m++) {
        __m256 v = _mm256_add_ps(acc[m], b);
        if (res) v = _mm256_add_ps(v, load8(res, bf16, at + m * N));
        if (gelu) v = gelu_erf(v);
        store8(y, bf16, at + m * N, v);
    }
}

void affine_gemm_rows(const void *x, _Bool bf16, int64_t M, int64_t K, const uint8_t *w,
                      int64_t N, const float *bias, const void *res, int gelu, int terms,
                      void *y, int8_t *qx, float *dx, float *sx) {
    const int64_t xsize = bf16 ? 2 : 4;
    const int64_t groups = K / GROUP, tiles = N / TILE, tile_bytes = groups * (8 * 64 + 64);
    const int64_t chunks = (M + RCHUNK - 1) / RCHUNK;
    const int rb = mblock(8, terms);
    /* rows per chunk: M spread evenly, whole register blocks (see the AVX-512 version) */
    const int64_t per = ((M + chunks - 1) / chunks + MAX_MB - 1) / MAX_MB * MAX_MB;
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
        for (int64_t job = 0; job < chunks * tiles; job++) {
            const int64_t c = job / tiles, t = job % tiles;
            const int64_t end = (c + 1) * per < M ? (c + 1) * per : M;
            for (int h = 0; h < 2; h++)
                for (int64_t m0 = c * per; m0 < end; m0 += rb) {
                    const int mb = (int)(end - m0 < rb ? end - m0 : rb);
                    __m256 acc[MAX_MB];
                    unit_dispatch(w + t * tile_bytes, h, 8, terms, mb, groups, qx + terms * m0 * K,
                                  terms * K, dx + m0 * groups, sx + m0 * groups, acc);
                    const int64_t col = t * TILE + 8 * h;
                    rows_store(acc, mb, bias ? bias + col : 0, res, gelu, y, bf16, N, m0 * N + col);
                }
        }
    }
}
#endif

/* Rows ``rows[0 .. R)`` of the weight dequantized to float32 out [R, K] (an embedding
 * lookup): code * scale + offset, the product and the sum each rounded (not fused), as the
 * tensor expression this replaces computed them. A tile's group holds ``steps`` x 64 code
 * bytes ([step][16 rows][4 bytes]; 4-bit: input 8 step + j in byte j's low nibble, 8 step +
 * 4 + j in its high one; 8-bit: input 4 step + j) and then the rows' float16 scales and
 * offsets. */
__attribute__((optimize("fp-contract=off"))) void affine_rows(const uint8_t *w, int bits,
                                                              int64_t K, const int64_t *rows,
                                                              int64_t R, float *out) {
    const int steps = bits == 4 ? 4 : 8;
    const int64_t groups = K / GROUP, group_bytes = (int64_t)steps * 64 + 64;
    for (int64_t i = 0; i < R; i++) {
        const int64_t r = rows[i], lane = r % TILE;
        const uint8_t *tile = w + r / TILE * groups * group_bytes;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *gw = tile + g * group_bytes;
            const uint16_t *so = (const uint16_t *)(gw + steps * 64);
            const float scale = _cvtsh_ss(so[lane]), offset = _cvtsh_ss(so[TILE + lane]);
            float *o = out + i * K + g * GROUP;
            for (int s = 0; s < steps; s++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t byte = gw[(s * TILE + lane) * 4 + j];
                    if (bits == 4) {
                        const float lo = (float)(byte & 0x0f) * scale, hi = (float)(byte >> 4) * scale;
                        o[8 * s + j] = lo + offset;
                        o[8 * s + 4 + j] = hi + offset;
                    } else {
                        const float v = (float)byte * scale;
                        o[4 * s + j] = v + offset;
                    }
                }
        }
    }
}
