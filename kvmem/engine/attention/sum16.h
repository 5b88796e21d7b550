/* sum16: sixteen AVX-512 vectors' lane sums as one vector, shared by the CPU kernels. */
#ifndef KVMEM_SUM16_H
#define KVMEM_SUM16_H
#include <immintrin.h>

/* out[t] = the sum of v[t]'s 16 lanes, for 16 vectors at once (a transpose-and-add tree). */
static inline __m512 sum16(const __m512 *v) {
    __m512 u[8], w[4];
    for (int i = 0; i < 8; ++i)  /* per 128-bit quarter: a0+a2 b0+b2 a1+a3 b1+b3 */
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  /* per quarter: rows 4i..4i+3, each over a quarter */
        const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                                     _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88),
                                     _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88),
                         _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

#endif
