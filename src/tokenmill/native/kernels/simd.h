/* A 16-float vector and the few operations the float kernels (decode.c, dense16_gemm.c) need,
 * so each kernel is written once for both ISA levels the library is built for:
 *
 *   AVX-512F:         vf16 is one __m512;
 *   AVX2 + FMA + F16C: vf16 is two __m256, lanes 0-7 (lo) and 8-15 (hi).
 *
 * Every operation works lane by lane with the same float32 rounding on both (the same
 * fused multiply-adds, the same additions in the same order), so a kernel written on vf16
 * gives the same bits at either level (the reductions below fix their order for that). VF16_REGS is how many vf16 fit in the register file
 * (32 zmm / 16 ymm = 8 pairs): register blocks are sized from it.
 */
#ifndef TOKENMILL_SIMD_H
#define TOKENMILL_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SIMD_INLINE static inline __attribute__((always_inline))

#ifdef __AVX512F__
#define VF16_REGS 32

typedef __m512 vf16;

SIMD_INLINE vf16 vf16_zero(void) { return _mm512_setzero_ps(); }
SIMD_INLINE vf16 vf16_load(const float *p) { return _mm512_loadu_ps(p); }
SIMD_INLINE void vf16_store(float *p, vf16 a) { _mm512_storeu_ps(p, a); }
SIMD_INLINE vf16 vf16_set1(float x) { return _mm512_set1_ps(x); }
SIMD_INLINE vf16 vf16_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }
SIMD_INLINE vf16 vf16_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
SIMD_INLINE vf16 vf16_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
SIMD_INLINE vf16 vf16_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
SIMD_INLINE vf16 vf16_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
SIMD_INLINE vf16 vf16_round(vf16 a) { /* to the nearest integer, ties to even */
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
SIMD_INLINE vf16 vf16_scale2(vf16 p, vf16 n) { return _mm512_scalef_ps(p, n); } /* p 2^n */

/* the first n (0 .. 16) lanes of a to p */
SIMD_INLINE void vf16_store_n(float *p, vf16 a, int n) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a);
}
/* p[0 .. n - 1] (n <= 16), zero in the other lanes; nothing past them is read */
SIMD_INLINE vf16 vf16_load_n(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}

/* 32 bfloat16 at p (64 bytes): the even ones (low halves of each 32 bits) / the odd ones
 * (high halves) widened to float32, exactly */
SIMD_INLINE vf16 vf16_bf16_even(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)p), 16));
}
SIMD_INLINE vf16 vf16_bf16_odd(const uint16_t *p) {
    const __m512i w = _mm512_loadu_si512((const void *)p);
    return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000)));
}

/* 16 float16 at p (32 bytes) -> float32 */
SIMD_INLINE vf16 vf16_from_fp16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* (p[0], p[1]) in every pair of lanes */
SIMD_INLINE vf16 vf16_set1_pair(const float *p) {
    int64_t pair;
    memcpy(&pair, p, 8);
    return _mm512_castsi512_ps(_mm512_set1_epi64(pair));
}

/* lane i < 8: a[2i] + a[2i + 1]; lane 8 + i: b[2i] + b[2i + 1] */
SIMD_INLINE vf16 vf16_pair_sums(vf16 a, vf16 b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

/* Round b of a 16 x 16 transpose (rows x lanes): swap the off-diagonal b x b blocks of each
 * 2b x 2b block. Row i (bit b clear) keeps its lanes without bit b (LO), row i + b those
 * with it (HI); index 16 + l is lane l of row i + b. Rounds 8, 4, 2, 1 transpose. */
static const int32_t VF16_TRANSPOSE_LO[4][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const int32_t VF16_TRANSPOSE_HI[4][16] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};

/* r[i] lane l <- r[l] lane i */
SIMD_INLINE void vf16_transpose(vf16 *r) {
#pragma GCC unroll 4
    for (int round = 0; round < 4; round++) {
        const int b = 8 >> round;
        const __m512i lo = _mm512_loadu_si512(VF16_TRANSPOSE_LO[round]);
        const __m512i hi = _mm512_loadu_si512(VF16_TRANSPOSE_HI[round]);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            if (i & b) continue;
            __m512 x = r[i], y = r[i + b];
            r[i] = _mm512_permutex2var_ps(x, lo, y);
            r[i + b] = _mm512_permutex2var_ps(x, hi, y);
        }
    }
}

#else /* AVX2 + FMA + F16C */
#define VF16_REGS 8

typedef struct {
    __m256 lo, hi;
} vf16;

SIMD_INLINE vf16 vf16_zero(void) { return (vf16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
SIMD_INLINE vf16 vf16_load(const float *p) {
    return (vf16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
SIMD_INLINE void vf16_store(float *p, vf16 a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
SIMD_INLINE vf16 vf16_set1(float x) {
    const __m256 v = _mm256_set1_ps(x);
    return (vf16){v, v};
}
SIMD_INLINE vf16 vf16_fmadd(vf16 a, vf16 b, vf16 c) {
    return (vf16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
SIMD_INLINE vf16 vf16_add(vf16 a, vf16 b) {
    return (vf16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
SIMD_INLINE vf16 vf16_mul(vf16 a, vf16 b) {
    return (vf16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
SIMD_INLINE vf16 vf16_sub(vf16 a, vf16 b) {
    return (vf16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
SIMD_INLINE vf16 vf16_max(vf16 a, vf16 b) {
    return (vf16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}
SIMD_INLINE vf16 vf16_round(vf16 a) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return (vf16){_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
/* p 2^n for integral n in [-126, 127]: a multiply by the exact power, rounded once as
 * scalef rounds */
SIMD_INLINE __m256 scale2_8(__m256 p, __m256 n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
SIMD_INLINE vf16 vf16_scale2(vf16 p, vf16 n) {
    return (vf16){scale2_8(p.lo, n.lo), scale2_8(p.hi, n.hi)};
}

SIMD_INLINE void vf16_store_n(float *p, vf16 a, int n) {
    float tmp[16];
    vf16_store(tmp, a);
    memcpy(p, tmp, (size_t)n * sizeof(float));
}
SIMD_INLINE vf16 vf16_load_n(const float *p, int n) {
    float tmp[16] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(float));
    return vf16_load(tmp);
}

SIMD_INLINE vf16 vf16_bf16_even(const uint16_t *p) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)p);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 16));
    return (vf16){_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                  _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
}
SIMD_INLINE vf16 vf16_bf16_odd(const uint16_t *p) {
    const __m256i m = _mm256_set1_epi32((int)0xffff0000);
    const __m256i a = _mm256_loadu_si256((const __m256i *)p);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 16));
    return (vf16){_mm256_castsi256_ps(_mm256_and_si256(a, m)),
                  _mm256_castsi256_ps(_mm256_and_si256(b, m))};
}

SIMD_INLINE vf16 vf16_from_fp16(const uint16_t *p) {
    return (vf16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}

SIMD_INLINE vf16 vf16_set1_pair(const float *p) {
    int64_t pair;
    memcpy(&pair, p, 8);
    const __m256 v = _mm256_castsi256_ps(_mm256_set1_epi64x(pair));
    return (vf16){v, v};
}

/* hadd(x, y) per 128-bit half: x0+x1, x2+x3, y0+y1, y2+y3; the 64-bit quarters 0, 2, 1, 3
 * then put the sums of x's 8 lanes before y's */
SIMD_INLINE __m256 pair_sums8(__m256 x, __m256 y) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(x, y)), 0xd8));
}
SIMD_INLINE vf16 vf16_pair_sums(vf16 a, vf16 b) {
    return (vf16){pair_sums8(a.lo, a.hi), pair_sums8(b.lo, b.hi)};
}

/* r[i] lane l <- r[l] lane i for 8 x 8 floats */
SIMD_INLINE void transpose8(__m256 *r0, __m256 *r1, __m256 *r2, __m256 *r3, __m256 *r4,
                            __m256 *r5, __m256 *r6, __m256 *r7) {
    const __m256 t0 = _mm256_unpacklo_ps(*r0, *r1), t1 = _mm256_unpackhi_ps(*r0, *r1);
    const __m256 t2 = _mm256_unpacklo_ps(*r2, *r3), t3 = _mm256_unpackhi_ps(*r2, *r3);
    const __m256 t4 = _mm256_unpacklo_ps(*r4, *r5), t5 = _mm256_unpackhi_ps(*r4, *r5);
    const __m256 t6 = _mm256_unpacklo_ps(*r6, *r7), t7 = _mm256_unpackhi_ps(*r6, *r7);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    *r0 = _mm256_permute2f128_ps(s0, s4, 0x20), *r4 = _mm256_permute2f128_ps(s0, s4, 0x31);
    *r1 = _mm256_permute2f128_ps(s1, s5, 0x20), *r5 = _mm256_permute2f128_ps(s1, s5, 0x31);
    *r2 = _mm256_permute2f128_ps(s2, s6, 0x20), *r6 = _mm256_permute2f128_ps(s2, s6, 0x31);
    *r3 = _mm256_permute2f128_ps(s3, s7, 0x20), *r7 = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* The four 8 x 8 blocks transposed in place; then the two off-diagonal ones trade places
 * (row i's lanes 8-15 <-> row 8 + i's lanes 0-7). */
SIMD_INLINE void vf16_transpose(vf16 *r) {
    transpose8(&r[0].lo, &r[1].lo, &r[2].lo, &r[3].lo, &r[4].lo, &r[5].lo, &r[6].lo, &r[7].lo);
    transpose8(&r[0].hi, &r[1].hi, &r[2].hi, &r[3].hi, &r[4].hi, &r[5].hi, &r[6].hi, &r[7].hi);
    transpose8(&r[8].lo, &r[9].lo, &r[10].lo, &r[11].lo, &r[12].lo, &r[13].lo, &r[14].lo,
               &r[15].lo);
    transpose8(&r[8].hi, &r[9].hi, &r[10].hi, &r[11].hi, &r[12].hi, &r[13].hi, &r[14].hi,
               &r[15].hi);
    for (int i = 0; i < 8; i++) {
        const __m256 t = r[i].hi;
        r[i].hi = r[8 + i].lo;
        r[8 + i].lo = t;
    }
}
#endif

/* 0 + a[0] + a[1] + ... + a[15], in that order (the same bits at either level) */
SIMD_INLINE float vf16_sum_lanes(vf16 a) {
    float tmp[16], sum = 0.f;
    vf16_store(tmp, a);
    for (int i = 0; i < 16; i++) sum += tmp[i];
    return sum;
}

/* exp(y) for y <= 0 (clamped at -87: exp(-87) is about 1.6e-38, the float range's end):
 * y = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 Taylor polynomial in r (relative error about
 * 2e-7), times 2^n. The same operations at either level: the same bits. */
SIMD_INLINE vf16 vf16_exp_neg(vf16 y) {
    y = vf16_max(y, vf16_set1(-87.f));
    const vf16 n = vf16_round(vf16_mul(y, vf16_set1(1.44269504f)));
    vf16 r = vf16_fmadd(n, vf16_set1(-0.693145752f), y); /* ln 2 in two parts: r exact */
    r = vf16_fmadd(n, vf16_set1(-1.42860677e-6f), r);
    vf16 p = vf16_set1(1.f / 720);
    p = vf16_fmadd(p, r, vf16_set1(1.f / 120));
    p = vf16_fmadd(p, r, vf16_set1(1.f / 24));
    p = vf16_fmadd(p, r, vf16_set1(1.f / 6));
    p = vf16_fmadd(p, r, vf16_set1(0.5f));
    p = vf16_fmadd(p, r, vf16_set1(1.f));
    p = vf16_fmadd(p, r, vf16_set1(1.f));
    return vf16_scale2(p, n);
}

/* q . k over d floats: a fused multiply-add chain per lane over the 16-float chunks (the
 * last one zero-padded), then vf16_sum_lanes */
SIMD_INLINE float vf16_dot(const float *q, const float *k, int64_t d) {
    vf16 acc = vf16_zero();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) acc = vf16_fmadd(vf16_load(q + i), vf16_load(k + i), acc);
    if (i < d) {
        const int n = (int)(d - i);
        acc = vf16_fmadd(vf16_load_n(q + i, n), vf16_load_n(k + i, n), acc);
    }
    return vf16_sum_lanes(acc);
}

#endif
