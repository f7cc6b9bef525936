/* Row-wise argmax over a vocabulary: out[r] = the first index of row r's maximum, exactly
 * as torch.argmax(dim=-1) (a NaN counts as the maximum: the first NaN's index; a row of
 * -inf gives 0). Two passes over a row that is still in cache from the output head: the
 * maximum (and whether any NaN), then its first position. PyTorch's CPU argmax runs one
 * thread at a few GB/s; this is one call per step instead of the few tensor ops that made
 * it fast in Python (sampling/argmax.py), which cost more than the scan at one row.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != x[i]) return i;
    return -1;
}

/* Also the first step of dense16_greedy (dense16_gemm.c). */
int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0;
    float top = -INFINITY;
#ifdef __AVX512F__
    __m512 vtop = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vtop = _mm512_max_ps(vtop, v);
    }
    if (nan) return first_nan(x, i);
    top = _mm512_reduce_max_ps(vtop);
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return i; /* none before i (the vector part had none) */
        top = x[i] > top ? x[i] : top;
    }
    i = 0;
#ifdef __AVX512F__
    const __m512 want = _mm512_set1_ps(top);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), want, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == top) return i;
    return 0; /* unreachable: top is one of the values */
}

/* x [rows, n] float32 (row stride n) -> out [rows] int64 */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n > 262144)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}
