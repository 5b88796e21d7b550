/* Projections of a few rows (decode steps) with bf16 weights, on CPUs with AVX-512 BF16.
 *
 * y[m, n] = sum_k x[m, k] w[n, k] for bf16 x [M, K] and a bf16 weight w [N, K] kept as it
 * was loaded, accumulated in fp32 (VDPBF16PS: exact products of bf16 pairs, summed in
 * fp32). At these sizes a projection is bound by reading its weight, and this reads half
 * the bytes of the fp32 copy MKL's packed GEMM reads. Two weight rows at a time are dotted
 * with eight input rows (16 accumulators), and one transpose-and-add tree turns the 16
 * accumulators into their 16 sums. Called via ctypes from
 * kvmem/engine/models/packed_gemm.py; built with the other CPU kernels.
 */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "../attention/sum16.h"

#define ROWS 8  /* input rows per pass; two weight rows share their loads */

/* acc[m] += rows[m][k:k+32] . a, acc[ROWS + m] += rows[m][k:k+32] . b (pairs of bf16) */
#define DOT_STEP(LOAD)                                                                       \
    do {                                                                                     \
        const __m512bh a = (__m512bh)LOAD(w0 + k), b = (__m512bh)LOAD(w1 + k);               \
        for (int m = 0; m < ROWS; ++m) {                                                     \
            const __m512bh v = (__m512bh)LOAD(rows(m) + k);                                  \
            acc[m] = _mm512_dpbf16_ps(acc[m], v, a);                                         \
            acc[ROWS + m] = _mm512_dpbf16_ps(acc[ROWS + m], v, b);                           \
        }                                                                                    \
    } while (0)

#define LOAD_ALL(p) _mm512_loadu_si512(p)
#define LOAD_LIVE(p) _mm512_maskz_loadu_epi16(live, p)

/* The ROWS rows of x (row stride ldx) against weight rows w0 and w1; a tail of K under 32
 * is masked. */
static inline __m512 dot_pass(const uint16_t *x, int64_t ldx, int K, const uint16_t *w0,
                              const uint16_t *w1, int prefetch) {
#define rows(m) (x + (m) * ldx)
    __m512 acc[2 * ROWS];
    for (int i = 0; i < 2 * ROWS; ++i) acc[i] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        if (prefetch) {  /* rows a few ahead: the weight streams from memory once */
            _mm_prefetch((const char *)(w0 + 4 * (int64_t)K + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + 4 * (int64_t)K + k), _MM_HINT_T0);
        }
        DOT_STEP(LOAD_ALL);
    }
    if (k < K) {
        const __mmask32 live = (__mmask32)((1u << (K - k)) - 1);
        DOT_STEP(LOAD_LIVE);
    }
    return sum16(acc);  /* lanes 0-7: rows against n0, lanes 8-15: against n1 */
#undef rows
}

/* M must be a multiple of ROWS (the caller pads x with rows it then ignores). */
int kvmem_gemm_bf16(const uint16_t *x, int64_t ldx, int M, int K, int N, const uint16_t *w,
                    float *y, int64_t ldy) {
    if (M % ROWS) return -2;
    float sums[2 * ROWS] __attribute__((aligned(64)));
    for (int n = 0; n < N; n += 2) {
        const uint16_t *w0 = w + (int64_t)n * K;
        const uint16_t *w1 = n + 1 < N ? w0 + K : w0;
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            _mm512_store_ps(sums, dot_pass(x + m0 * ldx, ldx, K, w0, w1, m0 == 0));
            for (int m = 0; m < ROWS; ++m) {
                y[(m0 + m) * ldy + n] = sums[m];
                if (n + 1 < N) y[(m0 + m) * ldy + n + 1] = sums[ROWS + m];
            }
        }
    }
    return 0;
}
#else
int kvmem_gemm_bf16(const uint16_t *x, int64_t ldx, int M, int K, int N, const uint16_t *w,
                    float *y, int64_t ldy) {
    (void)x; (void)ldx; (void)M; (void)K; (void)N; (void)w; (void)y; (void)ldy;
    return -1;  /* no AVX-512 BF16 here: the caller keeps MKL's fp32 path */
}
#endif
