/* y[M, N] = x[M, K] . W^T for W stored in 16-bit floats (bfloat16 or float16), or in float32;
 * x, y and the accumulation in float32.
 *
 * Weight layout (built by tokenmill/native/dense16.py): tiles of 16 output rows, each
 * [K2 = ceil(K / 2)][16 rows][2 inputs] of 16-bit values (float32 for FP32_FMA), rows past N
 * and the input past K zero. One 64-byte load then holds inputs 2j, 2j + 1 of 16 rows (two
 * loads for float32). ``w`` is addressed in 16-bit units: a float32 tile is twice as long.
 *
 * Kernels (chosen once at load, see DENSE16_*):
 *   BF16_DP  bfloat16 on AVX512-BF16: vdpbf16ps multiplies bfloat16 pairs exactly and adds
 *            in float32. The activations are split in two bfloat16 terms, x ~= hi + lo with
 *            hi = bf16(x), lo = bf16(x - hi) (16 significant bits; relative error <= 2^-17),
 *            so the float32 activations are kept to about float32's accuracy, not rounded to
 *            bfloat16.
 *            Built only where the compiler targets AVX512-BF16; elsewhere BF16_DP runs as
 *            BF16_FMA (the same tiles).
 *   BF16_DP1 BF16_DP with the activations in one bfloat16 term (hi only: 8 significant
 *            bits, as a bfloat16 model computes): half the vdpbf16ps, twice the rate of
 *            the FMA kernels (activation_precision="low"; AVX512-BF16 only).
 *   BF16_FMA bfloat16 on AVX-512F or AVX2: the weights widened to float32 (a shift),
 *            float32 FMAs; the exact products of float32 weights (the fallback everywhere).
 *   FP16_FMA float16 through F16C (vcvtph2ps), float32 FMAs on input pairs, the pair lanes
 *            added at the end.
 *   BF16_AMX bfloat16 on AMX-BF16 tiles (Sapphire Rapids and later, where the OS grants the
 *            process the tile state: dense16_amx_enable): tdpbf16ps on the same weight tiles
 *            (a [K2][16][2] tile slice of 16 pairs is an AMX B tile as it lies), the same two
 *            bfloat16 activation terms as BF16_DP. Every token runs the same tile program
 *            whatever the batch (the rows of a tile product are independent), so one
 *            request's bits do not depend on its batch.
 *   FP32_FMA float32 weights, the same FMAs as FP16_FMA on (row, input pair) lanes. Where the
 *            BLAS PyTorch ships runs float32 at its AVX2 rate on an AVX-512 CPU (MKL on AMD:
 *            ~95 against this kernel's ~230 GMAC/s on two Zen 5 cores), float32 models go
 *            through it (see dense16.py's ``fp32_kernel``).
 * The FMA kernels are written once on simd.h's vf16 and give the same bits at both ISA
 * levels: only the register blocking differs.
 *
 * Blocking: 2 tiles (32 rows) x up to 4 tokens per register block on AVX-512 (2 tiles x 1
 * token or 1 tile x 2 tokens on AVX2), with separate accumulators per term (hi/lo,
 * even/odd input) so the FMA chains stay short. Tile pairs are split across OpenMP
 * threads (the runtime PyTorch loaded); a pair's weights are read from memory once and
 * serve every token from cache.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

int64_t argmax_row(const float *x, int64_t n); /* argmax.c */

#define TILE 16
/* tokens per register block: 4 x 2 tiles on AVX-512; 2 x 1 tile or 1 x 2 tiles on AVX2,
 * where 8 x 2 halves are the 16 ymm registers */
#define MBLOCK (VF16_REGS >= 32 ? 4 : 2)
#define PREFETCH 1024
/* Where one register block takes every token (decode: 1 to MBLOCK rows) the weights stream
 * through once: prefetched non-temporally they do not push out of the caches what the rest
 * of the step reuses (activations, the KV cache, the interpreter's own working set), which
 * otherwise comes back from memory every step. Measured on SmolLM2's bf16 decode (2 Zen 4
 * cores): steps 11-20% shorter than with the T0 prefetch or none, the kernel's own
 * streaming rate unchanged. */
#define NTA_PREFETCH 2048

enum {
    DENSE16_BF16_DP = 0,
    DENSE16_BF16_FMA = 1,
    DENSE16_FP16_FMA = 2,
    DENSE16_FP32_FMA = 3,
    DENSE16_BF16_AMX = 4,
    DENSE16_BF16_DP1 = 5,
};

int dense16_has_bf16(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* 1 where the library was built with AMX-BF16 and Linux lets this process use the tile
 * data state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; some VMs refuse it, and a tile
 * instruction without it is a SIGILL). Asked once; the grant is for every thread. */
int dense16_amx_enable(void) {
#ifdef HAVE_AMX
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* REQ_XCOMP_PERM */, 18) == 0;
    return granted;
#else
    return 0;
#endif
}

/* Per-thread scratch: the activations padded to 2 K2 (and split in hi/lo for BF16_DP). */
static _Thread_local void *scratch;
static _Thread_local size_t scratch_size;

static void *scratch_for(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch);
        scratch_size = bytes * 2;
        scratch = aligned_alloc(64, (scratch_size + 63) / 64 * 64);
    }
    return scratch;
}

/* tb tiles (1 or 2) x mb tokens (<= MBLOCK; tb * mb <= 2 on AVX2). xs: per token 2 K2
 * values (BF16_DP: the hi bfloat16 then, xs_lo, the lo ones; else float32). out [tb][MBLOCK]
 * [16]. Always inlined with constant kernel, tb and mb (see block_dispatch) so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_kernel(
    const int kernel, const uint16_t *w, int64_t tile_elems, const int tb, const int mb,
    const void *xs, const void *xs_lo, int64_t K2, int once, const char *pf, int64_t pf_every,
    int64_t pf_lines, float *out) {
    vf16 acc[2][MBLOCK][2];
    for (int t = 0; t < 2; t++)
        for (int m = 0; m < MBLOCK; m++) acc[t][m][0] = acc[t][m][1] = vf16_zero();
    int64_t pf_at = 0, pf_line = 0; /* next_pair's share: one line every pf_every k pairs */
    for (int64_t j = 0; j < K2; j++) {
        if (pf && j == pf_at && pf_line < pf_lines) {
            _mm_prefetch(pf + pf_line++ * 64, _MM_HINT_T0);
            pf_at += pf_every;
        }
        const uint16_t *p[2];
        for (int t = 0; t < tb; t++) {
            p[t] = w + t * tile_elems + j * (kernel == DENSE16_FP32_FMA ? 64 : 32);
            if (once) { /* no other block reads these weights: see NTA_PREFETCH */
                _mm_prefetch((const char *)p[t] + NTA_PREFETCH, _MM_HINT_NTA);
                if (kernel == DENSE16_FP32_FMA) _mm_prefetch((const char *)p[t] + NTA_PREFETCH + 64, _MM_HINT_NTA);
                continue;
            }
            _mm_prefetch((const char *)p[t] + PREFETCH, _MM_HINT_T0);
            if (kernel == DENSE16_FP32_FMA) _mm_prefetch((const char *)p[t] + PREFETCH + 64, _MM_HINT_T0);
        }
        if (kernel == DENSE16_BF16_DP || kernel == DENSE16_BF16_DP1) {
#ifdef __AVX512BF16__
            __m512i wv[2];
            for (int t = 0; t < tb; t++) wv[t] = _mm512_loadu_si512((const void *)p[t]);
            for (int m = 0; m < mb; m++) {
                __m512bh hi = (__m512bh)_mm512_set1_epi32(((const int32_t *)xs)[m * K2 + j]);
                for (int t = 0; t < tb; t++)
                    acc[t][m][0] = _mm512_dpbf16_ps(acc[t][m][0], (__m512bh)wv[t], hi);
                if (kernel == DENSE16_BF16_DP1) continue; /* acc[..][1] stays 0 */
                __m512bh lo = (__m512bh)_mm512_set1_epi32(((const int32_t *)xs_lo)[m * K2 + j]);
                for (int t = 0; t < tb; t++)
                    acc[t][m][1] = _mm512_dpbf16_ps(acc[t][m][1], (__m512bh)wv[t], lo);
            }
#endif
        } else if (kernel == DENSE16_BF16_FMA) {
            vf16 we[2], wo[2];
            for (int t = 0; t < tb; t++) we[t] = vf16_bf16_even(p[t]), wo[t] = vf16_bf16_odd(p[t]);
            for (int m = 0; m < mb; m++) {
                const float *xm = (const float *)xs + m * 2 * K2 + 2 * j;
                const vf16 x0 = vf16_set1(xm[0]), x1 = vf16_set1(xm[1]);
                for (int t = 0; t < tb; t++) {
                    acc[t][m][0] = vf16_fmadd(we[t], x0, acc[t][m][0]);
                    acc[t][m][1] = vf16_fmadd(wo[t], x1, acc[t][m][1]);
                }
            }
        } else { /* FP16 / FP32: lanes (row r, input 2j + p) for rows 0-7 (a) and 8-15 (b) */
            vf16 wa[2], wb[2];
            for (int t = 0; t < tb; t++) {
                if (kernel == DENSE16_FP32_FMA) {
                    wa[t] = vf16_load((const float *)p[t]), wb[t] = vf16_load((const float *)p[t] + 16);
                } else {
                    wa[t] = vf16_from_fp16(p[t]), wb[t] = vf16_from_fp16(p[t] + 16);
                }
            }
            for (int m = 0; m < mb; m++) {
                /* (x[2j], x[2j+1]), broadcast 8 times */
                const vf16 xp = vf16_set1_pair((const float *)xs + m * 2 * K2 + 2 * j);
                for (int t = 0; t < tb; t++) {
                    acc[t][m][0] = vf16_fmadd(wa[t], xp, acc[t][m][0]);
                    acc[t][m][1] = vf16_fmadd(wb[t], xp, acc[t][m][1]);
                }
            }
        }
    }
    for (int t = 0; t < tb; t++)
        for (int m = 0; m < mb; m++) {
            const vf16 a = acc[t][m][0], b = acc[t][m][1];
            /* FP16 / FP32: add each row's two input lanes */
            const int pairs = kernel == DENSE16_FP16_FMA || kernel == DENSE16_FP32_FMA;
            const vf16 r = pairs ? vf16_pair_sums(a, b) : vf16_add(a, b);
            vf16_store(out + (t * MBLOCK + m) * TILE, r);
        }
}

#define BLOCK_CASE(KERNEL, TB, MB)                                                            \
    case ((KERNEL) * 4 + (TB)) * 8 + (MB):                                                    \
        block_kernel(KERNEL, w, tile_elems, TB, MB, xs, xs_lo, K2, once, pf, pf_every, pf_lines, \
                     out);                                                                    \
        break;
#if MBLOCK == 4
#define BLOCK_CASES(KERNEL, TB)                                                               \
    BLOCK_CASE(KERNEL, TB, 1) BLOCK_CASE(KERNEL, TB, 2) BLOCK_CASE(KERNEL, TB, 3)             \
    BLOCK_CASE(KERNEL, TB, 4)
#else
#define BLOCK_CASES(KERNEL, TB) BLOCK_CASE(KERNEL, TB, 1) BLOCK_CASE(KERNEL, TB, 2)
#endif

#define ALL_BLOCK_CASES                                                                       \
    BLOCK_CASES(DENSE16_BF16_DP, 1) BLOCK_CASES(DENSE16_BF16_DP, 2)                           \
    BLOCK_CASES(DENSE16_BF16_FMA, 1) BLOCK_CASES(DENSE16_BF16_FMA, 2)                         \
    BLOCK_CASES(DENSE16_FP16_FMA, 1) BLOCK_CASES(DENSE16_FP16_FMA, 2)                         \
    BLOCK_CASES(DENSE16_FP32_FMA, 1) BLOCK_CASES(DENSE16_FP32_FMA, 2)                         \
    BLOCK_CASES(DENSE16_BF16_DP1, 1) BLOCK_CASES(DENSE16_BF16_DP1, 2)

/* A register block that also fetches its share of the next tile pair (next_pair). */
static void block_dispatch_pf(int kernel, const uint16_t *w, int64_t tile_elems, int tb, int mb,
                              const void *xs, const void *xs_lo, int64_t K2, int once,
                              const char *pf, int64_t pf_every, int64_t pf_lines, float *out) {
    switch ((kernel * 4 + tb) * 8 + mb) { ALL_BLOCK_CASES }
}

/* A register block alone: its own copy of the cases, with no next-pair test in the loop. */
static void block_dispatch(int kernel, const uint16_t *w, int64_t tile_elems, int tb, int mb,
                           const void *xs, const void *xs_lo, int64_t K2, int once, float *out) {
    const char *const pf = 0;
    const int64_t pf_every = 1, pf_lines = 0;
    switch ((kernel * 4 + tb) * 8 + mb) { ALL_BLOCK_CASES }
}

/* Token m's activations into the kernel's form: 2 K2 float32 (zero past K) or, for BF16_DP
 * (and AMX), 2 K2 bfloat16 hi terms and 2 K2 lo terms; BF16_DP1 the hi terms only. */
static void prepare_row(int kernel, const float *x, int64_t K, int64_t row, float *xf, uint16_t *hi,
                        uint16_t *lo) {
    if (kernel != DENSE16_BF16_DP && kernel != DENSE16_BF16_DP1 && kernel != DENSE16_BF16_AMX) {
        memcpy(xf, x, K * sizeof(float));
        if (K < row) xf[K] = 0.f;
        return;
    }
#ifdef __AVX512BF16__
    for (int64_t k = 0; k < row; k += 16) {
        int64_t left = K - k;
        __mmask16 mask = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        __m512 v = _mm512_maskz_loadu_ps(mask, x + k);
        __m256bh h = _mm512_cvtneps_pbh(v);
        __mmask16 store = row - k >= 16 ? 0xffff : (__mmask16)((1u << (row - k)) - 1);
        _mm256_mask_storeu_epi16(hi + k, store, (__m256i)h);
        if (kernel == DENSE16_BF16_DP1) continue; /* it never reads the lo terms */
        __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
        __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
        _mm256_mask_storeu_epi16(lo + k, store, (__m256i)l);
    }
#endif
}

#ifdef HAVE_AMX
/* AMX: tiles 0-3 accumulate C[token block b][weight tile t] (16 x 16 float32, tile 2 b + t),
 * 4-5 hold the weights of k block kb for tiles t = 0, 1 (16 pairs x 16 rows: 1 KB), 6-7
 * the hi (then lo) terms of token blocks 0, 1 (16 tokens x 32 inputs). Per k block each C
 * takes hi . B then lo . B, the four hi products before the four lo ones so no product
 * waits on the one before it. */
#define AMX_KB 32 /* inputs per k block */
#define AMX_PREFETCH 2
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* C (0-3) and A (6-7) tiles of ``rows`` token rows (a product's time follows its rows),
 * B (4-5) tiles of 16 input pairs */
static void amx_configure(int rows) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = t == 4 || t == 5 ? 16 : rows, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

#define AMX_DP_BLOCK(A_HI0, A_HI1, A_LO0, A_LO1, B0, B1, STRIDE_A)                            \
    _tile_loadd(4, B0, 64);                                                                 \
    _tile_loadd(5, B1, 64);                                                                 \
    _tile_loadd(6, A_HI0, STRIDE_A);                                                        \
    _tile_loadd(7, A_HI1, STRIDE_A);                                                        \
    _tile_dpbf16ps(0, 6, 4);                                                                \
    _tile_dpbf16ps(1, 6, 5);                                                                \
    _tile_dpbf16ps(2, 7, 4);                                                                \
    _tile_dpbf16ps(3, 7, 5);                                                                \
    _tile_loadd(6, A_LO0, STRIDE_A);                                                        \
    _tile_loadd(7, A_LO1, STRIDE_A);                                                        \
    _tile_dpbf16ps(0, 6, 4);                                                                \
    _tile_dpbf16ps(1, 6, 5);                                                                \
    _tile_dpbf16ps(2, 7, 4);                                                                \
    _tile_dpbf16ps(3, 7, 5);

/* M <= 16 (decode, a short verify): one token block against 4 weight tiles at a time;
 * tiles 0-3 are C[t], 4-5 the weights of two tiles, 6-7 the hi and lo terms. Each C row
 * sees the same products in the same order as in the two-block program (hi . B then lo . B
 * per 32-input block): the same bits. */
static void amx_gemm_one_block(const uint16_t *hi, const uint16_t *lo, int64_t M, int64_t row,
                               const uint16_t *w, int64_t K2, int64_t N, float *y) {
    const int64_t tiles = (N + TILE - 1) / TILE, quads = (tiles + 3) / 4;
    const int64_t kblocks = row / AMX_KB, full = K2 / 16, tile_elems = K2 * 32, sa = row * 2;
#pragma omp parallel
    {
        amx_configure((int)M);
        uint16_t tail[4][16 * 32] __attribute__((aligned(64)));
        float out[4][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t q = 0; q < quads; q++) {
            const uint16_t *wt[4];
            for (int t = 0; t < 4; t++) /* tiles past N read the quad's first again */
                wt[t] = w + (4 * q + t < tiles ? 4 * q + t : 4 * q) * tile_elems;
            if (full < kblocks) {
                memset(tail, 0, sizeof tail);
                for (int t = 0; t < 4; t++) memcpy(tail[t], wt[t] + full * 512, (K2 - full * 16) * 64);
            }
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < kblocks; kb++) {
                const uint16_t *b[4];
                for (int t = 0; t < 4; t++) b[t] = kb < full ? wt[t] + kb * 512 : tail[t];
                /* decode streams the weights from memory: keep AMX_PREFETCH k blocks of
                 * each tile in flight (tile loads do not start the hardware prefetchers
                 * early enough) */
                if (kb + AMX_PREFETCH < full)
                    for (int t = 0; t < 4; t++)
                        for (int l = 0; l < 16; l++)
                            _mm_prefetch((const char *)(wt[t] + (kb + AMX_PREFETCH) * 512) + 64 * l, _MM_HINT_T0);
                _tile_loadd(6, hi + kb * AMX_KB, sa);
                _tile_loadd(7, lo + kb * AMX_KB, sa);
                _tile_loadd(4, b[0], 64);
                _tile_loadd(5, b[1], 64);
                _tile_dpbf16ps(0, 6, 4);
                _tile_dpbf16ps(1, 6, 5);
                _tile_dpbf16ps(0, 7, 4);
                _tile_dpbf16ps(1, 7, 5);
                _tile_loadd(4, b[2], 64);
                _tile_loadd(5, b[3], 64);
                _tile_dpbf16ps(2, 6, 4);
                _tile_dpbf16ps(3, 6, 5);
                _tile_dpbf16ps(2, 7, 4);
                _tile_dpbf16ps(3, 7, 5);
            }
            if ((4 * q + 4) * TILE <= N) { /* four whole tiles: straight into y */
                _tile_stored(0, y + (4 * q + 0) * TILE, N * 4);
                _tile_stored(1, y + (4 * q + 1) * TILE, N * 4);
                _tile_stored(2, y + (4 * q + 2) * TILE, N * 4);
                _tile_stored(3, y + (4 * q + 3) * TILE, N * 4);
                continue;
            }
            _tile_stored(0, out[0], 64);
            _tile_stored(1, out[1], 64);
            _tile_stored(2, out[2], 64);
            _tile_stored(3, out[3], 64);
            for (int t = 0; t < 4 && 4 * q + t < tiles; t++) {
                const int64_t n0 = (4 * q + t) * TILE;
                const int64_t cols = N - n0 < TILE ? N - n0 : TILE;
                for (int64_t r = 0; r < M; r++)
                    memcpy(y + r * N + n0, out[t] + r * 16, cols * sizeof(float));
            }
        }
        _tile_release();
    }
}

/* hi / lo: [Mpad][row] bfloat16 (row = 32 KB, zero past K; Mpad a multiple of 32 rows, the
 * rows past M any value: their products land in rows of C nobody reads). */
static void amx_gemm(const uint16_t *hi, const uint16_t *lo, int64_t M, int64_t row,
                     const uint16_t *w, int64_t K2, int64_t N, float *y) {
    const int64_t tiles = (N + TILE - 1) / TILE, pairs = (tiles + 1) / 2;
    const int64_t kblocks = row / AMX_KB, full = K2 / 16, tile_elems = K2 * 32;
    const int64_t mblocks = (M + 31) / 32, sa = row * 2;
#pragma omp parallel
    {
        amx_configure(16);
        uint16_t tail[2][16 * 32] __attribute__((aligned(64)));
        float out[4][16 * 16] __attribute__((aligned(64)));
        /* tokens in chunks whose two terms (chunk x row x 4 bytes) stay in L2 while every
         * weight pair passes over them */
        int64_t chunk = (256 * 1024 / (row * 4)) / 32 * 32;
        chunk = chunk < 32 ? 32 : chunk;
        for (int64_t c0 = 0; c0 < mblocks * 32; c0 += chunk) {
        const int64_t c1 = c0 + chunk < mblocks * 32 ? c0 + chunk : mblocks * 32;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < pairs; p++) {
            /* a second tile past N reads the first again: its C is thrown away */
            const uint16_t *w0 = w + 2 * p * tile_elems;
            const uint16_t *w1 = 2 * p + 1 < tiles ? w0 + tile_elems : w0;
            if (full < kblocks) { /* the last k block has K2 % 16 pairs: zero the rest */
                memset(tail, 0, sizeof tail);
                memcpy(tail[0], w0 + full * 512, (K2 - full * 16) * 64);
                memcpy(tail[1], w1 + full * 512, (K2 - full * 16) * 64);
            }
            for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                const uint16_t *h0 = hi + m0 * row, *l0 = lo + m0 * row;
                const int two = M - m0 > 16; /* token blocks here: the last may be 1 */
                _tile_zero(0);
                _tile_zero(1);
                if (two) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int64_t kb = 0; kb < kblocks; kb++) {
                    const uint16_t *b0 = kb < full ? w0 + kb * 512 : tail[0];
                    const uint16_t *b1 = kb < full ? w1 + kb * 512 : tail[1];
                    const int64_t k = kb * AMX_KB;
                    if (m0 == c0 && kb + AMX_PREFETCH < full)
                        for (int l = 0; l < 16; l++) {
                            _mm_prefetch((const char *)(w0 + (kb + AMX_PREFETCH) * 512) + 64 * l, _MM_HINT_T0);
                            _mm_prefetch((const char *)(w1 + (kb + AMX_PREFETCH) * 512) + 64 * l, _MM_HINT_T0);
                        }
                    if (two) {
                        AMX_DP_BLOCK(h0 + k, h0 + 16 * row + k, l0 + k, l0 + 16 * row + k, b0, b1, sa)
                    } else { /* the same products in the same order for each C row */
                        _tile_loadd(4, b0, 64);
                        _tile_loadd(5, b1, 64);
                        _tile_loadd(6, h0 + k, sa);
                        _tile_loadd(7, l0 + k, sa);
                        _tile_dpbf16ps(0, 6, 4);
                        _tile_dpbf16ps(1, 6, 5);
                        _tile_dpbf16ps(0, 7, 4);
                        _tile_dpbf16ps(1, 7, 5);
                    }
                }
                if (m0 + 32 <= M && (2 * p + 2) * TILE <= N) { /* whole tiles: into y */
                    float *c = y + m0 * N + 2 * p * TILE;
                    _tile_stored(0, c, N * 4);
                    _tile_stored(1, c + TILE, N * 4);
                    _tile_stored(2, c + 16 * N, N * 4);
                    _tile_stored(3, c + 16 * N + TILE, N * 4);
                    continue;
                }
                _tile_stored(0, out[0], 64);
                _tile_stored(1, out[1], 64);
                if (two) {
                    _tile_stored(2, out[2], 64);
                    _tile_stored(3, out[3], 64);
                }
                for (int t = 0; t < 2 && 2 * p + t < tiles; t++) {
                    const int64_t n0 = (2 * p + t) * TILE;
                    const int64_t cols = N - n0 < TILE ? N - n0 : TILE;
                    for (int b = 0; b < 1 + two; b++)
                        for (int r = 0; r < 16 && m0 + 16 * b + r < M; r++)
                            memcpy(y + (m0 + 16 * b + r) * N + n0, out[2 * b + t] + r * 16,
                                   cols * sizeof(float));
                }
            }
        }
        }
        _tile_release();
    }
}
#endif

/* The next tile pair's weights, fetched a share per register block while the current
 * pair's blocks run from cache: where four or more blocks of tokens share a pair, the
 * pair after it is then in L1/L2 when its first block starts, instead of coming from
 * memory under the T0 prefetch's short lead alone (measured on two Zen 4 cores, 30 layers
 * of SmolLM2 bf16 shapes plus its 49k-row head, alternating in one process: layers 13%
 * shorter at 16 tokens, 12% at 24, 4% at 32, 9% at 64; the one-term head 18% at 32; at 3
 * blocks (9 tokens) 6% longer, hence the threshold). */
#define NEXT_PAIR_MIN_BLOCKS 4

typedef struct {
    const char *at; /* the lines this block fetches, from here (NULL: none) */
    int64_t every;  /* one line every ``every`` k pairs of the block */
    int64_t lines;
} NextPair;

static NextPair next_pair(const uint16_t *wp, int64_t tile_elems, int64_t K2, int has_next,
                          int64_t mbi, int64_t mblocks) {
    NextPair none = {0, 1, 0};
    if (!has_next || mblocks < NEXT_PAIR_MIN_BLOCKS) return none;
    const int64_t total = 2 * tile_elems * 2 / 64; /* the pair's 64-byte lines */
    const int64_t share = (total + mblocks - 1) / mblocks;
    if (mbi * share >= total) return none;
    NextPair next = {(const char *)(wp + 2 * tile_elems) + mbi * share * 64,
                     K2 / share > 0 ? K2 / share : 1, share};
    return next;
}

/* x [M, K] float32 (row stride K), w [ceil(N / 16)] tiles, y [M, N] float32. */
void dense16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, int kernel, int64_t N,
                  float *y) {
#ifndef HAVE_AMX
    if (kernel == DENSE16_BF16_AMX) kernel = DENSE16_BF16_DP; /* same tiles; not built here */
#else
    if (kernel == DENSE16_BF16_AMX && !dense16_amx_enable()) kernel = DENSE16_BF16_DP;
#endif
#ifndef __AVX512BF16__
    if (kernel == DENSE16_BF16_DP) kernel = DENSE16_BF16_FMA; /* same tiles; not built here */
    if (kernel == DENSE16_BF16_DP1) kernel = DENSE16_BF16_FMA; /* (dense16.py refuses it) */
#endif
#ifdef HAVE_AMX
    if (kernel == DENSE16_BF16_AMX) {
        const int64_t K2a = (K + 1) / 2, row = (2 * K2a + AMX_KB - 1) / AMX_KB * AMX_KB;
        const int64_t mpad = (M + 31) / 32 * 32;
        uint16_t *hi = scratch_for((size_t)mpad * row * 4 + 64), *lo = hi + mpad * row;
#pragma omp parallel for schedule(static) if (M * K > 65536)
        for (int64_t m = 0; m < M; m++)
            prepare_row(kernel, x + m * K, K, row, 0, hi + m * row, lo + m * row);
        if (M <= 16)
            amx_gemm_one_block(hi, lo, M, row, w, K2a, N, y);
        else
            amx_gemm(hi, lo, M, row, w, K2a, N, y);
        return;
    }
#endif
    const int64_t K2 = (K + 1) / 2, tiles = (N + TILE - 1) / TILE;
    const int64_t tile_elems = K2 * (kernel == DENSE16_FP32_FMA ? 64 : 32); /* 16-bit units */
    const int64_t row = 2 * K2; /* values per token in the scratch */
    const int dp = kernel == DENSE16_BF16_DP || kernel == DENSE16_BF16_DP1;
    char *buf = scratch_for((size_t)M * row * 4 + 64); /* 2 x bf16 or 1 x float32 each */
    float *xf = (float *)buf;
    uint16_t *hi = (uint16_t *)buf, *lo = hi + M * row;
    const void *xs = dp ? (const void *)hi : (const void *)xf;
    const void *xs_lo = lo;
    if (!dp && K == row) {
        xs = x; /* already in the kernel's form */
    } else {
#pragma omp parallel for schedule(static) if (M * K > 65536)
        for (int64_t m = 0; m < M; m++)
            prepare_row(kernel, x + m * K, K, row, xf + m * row, hi + m * row, lo + m * row);
    }
    const int64_t pairs = (tiles + 1) / 2, mblocks = (M + MBLOCK - 1) / MBLOCK;
    const int once = mblocks == 1; /* each weight read by one register block only */
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const int tb = 2 * p + 1 < tiles ? 2 : 1;
        const uint16_t *wp = w + 2 * p * tile_elems;
        for (int64_t mbi = 0; mbi < mblocks; mbi++) {
            const int64_t m0 = mbi * MBLOCK;
            const int mb = (int)(M - m0 < MBLOCK ? M - m0 : MBLOCK);
            float out[2 * MBLOCK * TILE];
            const int64_t xoff = m0 * (dp ? K2 : row); /* int32 pairs (dp) or floats */
            const void *xm = dp ? (const void *)((const int32_t *)xs + xoff)
                                : (const void *)((const float *)xs + xoff);
            const void *xm_lo = (const void *)((const int32_t *)xs_lo + m0 * K2);
            /* one tile at a time: on AVX2 (registers), and at one token, where each thread
             * then reads its weights as one sequential stream instead of two interleaved
             * ones (3-7% more bandwidth measured on Zen 4; a tile's sums do not depend on
             * its neighbour, so the bits are the same) */
            if (tb == 2 && ((VF16_REGS < 32 && mb > 1) || M == 1)) {
                block_dispatch(kernel, wp, tile_elems, 1, mb, xm, xm_lo, K2, once, out);
                block_dispatch(kernel, wp + tile_elems, tile_elems, 1, mb, xm, xm_lo, K2, once,
                               out + MBLOCK * TILE);
            } else {
                NextPair next = next_pair(wp, tile_elems, K2, p + 1 < pairs, mbi, mblocks);
                block_dispatch_pf(kernel, wp, tile_elems, tb, mb, xm, xm_lo, K2, once, next.at,
                                  next.every, next.lines, out);
            }
            for (int t = 0; t < tb; t++) {
                const int64_t n0 = (2 * p + t) * TILE;
                const int64_t cols = N - n0 < TILE ? N - n0 : TILE;
                for (int m = 0; m < mb; m++)
                    memcpy(y + (m0 + m) * N + n0, out + (t * MBLOCK + m) * TILE, cols * sizeof(float));
            }
        }
    }
}

/* Greedy decoding through a bfloat16 output head: ids[m] = the first index of the maximum
 * of row m of y = x . W^T as ``kernel`` (BF16_FMA or BF16_DP) computes it, without
 * computing all of y with it. One-term logits first (BF16_DP1, twice the exact kernels'
 * rate; approx [M, N] is their scratch), then the exact kernel only on the tiles of the
 * outputs that could be the maximum.
 *
 * Why that is exact: per output n, |y1[n] - y[n]| <= B with
 *   B = |x| * |w_n| * (2^-9 (hi = bf16(x) rounds each input to 8 significant bits)
 *                      + 4 (K + 2) 2^-24 (both kernels' float32 sums)) + flushed denormals,
 * |.| the Euclidean norms (Cauchy-Schwarz bounds sum |w_k x_k|), |w_n| <= wnorm, the
 * largest row norm. The exact maximum y[n*] >= y[m1] for the approximate one's index m1,
 * so y1[n*] >= y1[m1] - 2B: every output whose approximation is at least max(y1) - 2B is
 * computed exactly (its whole tile: one register block) and the first of the largest
 * wins. A tile's sums do not depend on the block around it (see dense16_gemm), so these
 * are the bits the full head gives. ids[m] = -1 where the row cannot be decided this way
 * (a non-finite input, approximation or exact candidate): compute that row in full. */
static int64_t greedy_row(const float *x, int64_t K, const uint16_t *w, int kernel, int64_t N,
                          double wnorm, const float *approx) {
    double ss = 0;
    for (int64_t k = 0; k < K; k++) ss += (double)x[k] * x[k];
    const float top = approx[argmax_row(approx, N)]; /* a NaN if the row has one */
    const double norm = sqrt(ss);
    if (!(fabsf(top) <= FLT_MAX) || !(norm <= 1e30)) return -1;
    const double rel = ldexp(1, -9) + 4.0 * (double)(K + 2) * ldexp(1, -24);
    const double slack = 1.01 * (norm * (wnorm * rel + ldexp(1, -120) * sqrt((double)K)) +
                                 (double)(K + 2) * ldexp(1, -124));
    const float floor_ = nextafterf((float)((double)top - 2 * slack), -INFINITY);
    const int64_t K2 = (K + 1) / 2, row = 2 * K2, tile_elems = K2 * 32;
    const int dp = kernel == DENSE16_BF16_DP;
    char *buf = scratch_for((size_t)row * 4 + 64);
    float *xf = (float *)buf;
    uint16_t *hi = (uint16_t *)buf, *lo = hi + row;
    prepare_row(kernel, x, K, row, xf, hi, lo);
    const void *xs = dp ? (const void *)hi : (const void *)xf;
    float out[2 * MBLOCK * TILE], best_value = 0;
    int64_t best = -1, tile = -1;
    for (int64_t n = 0; n < N; n++) {
#ifdef __AVX512F__
        if (n % 16 == 0 && n + 16 <= N &&
            !_mm512_cmp_ps_mask(_mm512_loadu_ps(approx + n), _mm512_set1_ps(floor_), _CMP_GE_OQ)) {
            n += 15; /* no candidate among these 16 */
            continue;
        }
#endif
        if (!(approx[n] >= floor_)) continue;
        if (n / TILE != tile) {
            tile = n / TILE;
            block_dispatch(kernel, w + tile * tile_elems, tile_elems, 1, 1, xs, lo, K2, 0, out);
        }
        const float v = out[n % TILE];
        if (!(fabsf(v) <= FLT_MAX)) return -1;
        if (best < 0 || v > best_value) best = n, best_value = v;
    }
    return best;
}

/* x [M, K] float32, w the bfloat16 tiles of an [N, K] head, kernel BF16_FMA or BF16_DP,
 * wnorm >= every row's Euclidean norm; approx [M, N] scratch -> ids [M] (see greedy_row). */
void dense16_greedy(const float *x, int64_t M, int64_t K, const uint16_t *w, int kernel,
                    int64_t N, float wnorm, float *approx, int64_t *ids) {
#ifndef __AVX512BF16__
    if (kernel == DENSE16_BF16_DP) kernel = DENSE16_BF16_FMA; /* as dense16_gemm runs it */
#endif
    dense16_gemm(x, M, K, w, DENSE16_BF16_DP1, N, approx);
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++)
        ids[m] = greedy_row(x + m * K, K, w, kernel, N, wnorm, approx + m * N);
}

/* Rows ``rows[0 .. R)`` of the weight as float32 out [R, K] (an embedding lookup): element
 * (r, k) lies at ((r / 16 * K2 + k / 2) * 16 + r % 16) * 2 + k % 2 of the tiles, in units of
 * their dtype (0 bfloat16, 1 float16, 2 float32); widening is exact. */
void dense16_rows(const void *w, int dtype, int64_t K, const int64_t *rows, int64_t R,
                  float *out) {
    const int64_t K2 = (K + 1) / 2;
    for (int64_t i = 0; i < R; i++) {
        const int64_t r = rows[i], base = (r / TILE * K2 * TILE + r % TILE) * 2;
        float *o = out + i * K;
        for (int64_t k = 0; k < K; k++) {
            const int64_t at = base + (k / 2) * TILE * 2 + k % 2;
            if (dtype == 2) {
                o[k] = ((const float *)w)[at];
            } else if (dtype == 1) {
                o[k] = _cvtsh_ss(((const uint16_t *)w)[at]);
            } else {
                const uint32_t bits = (uint32_t)((const uint16_t *)w)[at] << 16;
                memcpy(o + k, &bits, sizeof bits);
            }
        }
    }
}
